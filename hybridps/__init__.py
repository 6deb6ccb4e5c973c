"""HybridPS: a heterogeneous-memory parameter server for PyTorch training.

Model data (params, grads, fp32 master weights, Adam momentum and variance) lives in
fixed-size chunks that move between CPU and GPU memory on demand.

    import hybridps
    engine = hybridps.initialize(model, optimizer, config=hybridps.Config(devices={"cuda:0": "8GiB"}))
"""

from hybridps.common.lazy import lazy_exports
from hybridps.integrations import strategy_name as _strategy_name

__version__ = "0.1.0"

# Trainer(strategy="hybridps") in PyTorch Lightning, without importing Lightning here
# (integrations/strategy_name.py, [Note: registering with Lightning on import])
_strategy_name.register()


# [Note: a lazy package]
# The public names are imported on first use (PEP 562), so that ``import hybridps.manager``,
# which runs this file first, does not import torch: the per-node daemon (``hybridps-manager``)
# and ``hybridps status`` need pyzmq and msgpack only, and importing torch cost each of them
# about 1.9 s and the daemon about 200 MiB of resident memory. ``hybridps.client`` and
# ``hybridps.planner`` load their names the same way, and the parsers every ``hybridps``
# command builds read torch-free modules only (train_args.py, planner/defaults.py);
# tests/manager/test_footprint.py holds all of it.
_PUBLIC = {
    "ChunkState": "hybridps.client.chunks.states",
    "TensorState": "hybridps.client.chunks.states",
    "Client": "hybridps.client.client",
    "Config": "hybridps.common.config",
    "LossScaleConfig": "hybridps.common.config",
    "CapacityError": "hybridps.common.errors",
    "ConfigError": "hybridps.common.errors",
    "HybridPSError": "hybridps.common.errors",
    "ManagerError": "hybridps.common.errors",
    "ProtocolError": "hybridps.common.errors",
    "RegistrationError": "hybridps.common.errors",
    "StateError": "hybridps.common.errors",
    "meta_init": "hybridps.client.deferred_init",
    "Engine": "hybridps.engine",
    "initialize": "hybridps.engine",
    "init_distributed": "hybridps.launch",
    "plan": "hybridps.planner",
}


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())


__all__ = sorted([*_PUBLIC, "__version__"])  # what the package exports, derived from the map above
