"""HybridPS: a heterogeneous-memory parameter server for PyTorch training.

Model data (params, grads, fp32 master weights, Adam momentum and variance) lives in
fixed-size chunks that move between CPU and GPU memory on demand.

    import hybridps
    engine = hybridps.initialize(model, optimizer, config=hybridps.Config(devices={"cuda:0": "8GiB"}))
"""

from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.client import Client
from hybridps.common.config import Config, LossScaleConfig
from hybridps.common.errors import (
    CapacityError,
    ConfigError,
    HybridPSError,
    ManagerError,
    ProtocolError,
    RegistrationError,
    StateError,
)
from hybridps.deferred_init import meta_init
from hybridps.engine import Engine, initialize
from hybridps.integrations import strategy_name as _strategy_name
from hybridps.launch import init_distributed

__version__ = "0.1.0"

# Trainer(strategy="hybridps") in PyTorch Lightning, without importing Lightning here
# (integrations/strategy_name.py, [Note: registering with Lightning on import])
_strategy_name.register()


def __getattr__(name: str):
    # ``hybridps.plan`` (the capacity planner, hybridps/planner/) is imported on first use, so
    # ``import hybridps`` does not load the planner and its command line.
    if name == "plan":
        from hybridps.planner import plan

        return plan
    raise AttributeError(f"module 'hybridps' has no attribute {name!r}")


__all__ = [
    "CapacityError",
    "ChunkState",
    "Client",
    "Config",
    "ConfigError",
    "Engine",
    "HybridPSError",
    "LossScaleConfig",
    "ManagerError",
    "ProtocolError",
    "RegistrationError",
    "StateError",
    "TensorState",
    "__version__",
    "init_distributed",
    "initialize",
    "meta_init",
    "plan",
]
