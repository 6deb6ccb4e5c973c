"""Machine rates made up for the speed model's tests: a real GPU's composition, round figures."""

from __future__ import annotations

from hybridps.planner.rates import MachineRates


def synthetic_rates(**kw) -> MachineRates:
    """Rates of a made-up machine with a real GPU; ``kw`` replaces any field."""
    base = dict(
        name="test",
        device="synthetic",
        simulated_gpu=False,
        compute_tflops=((1024, 100.0), (4096, 400.0)),
        h2d_gbps=10.0,
        d2h_gbps=20.0,
        cpu_adam_params_per_s=1e9,
        cpu_compact_adam_params_per_s=5e8,
        cpu_cast_params_per_s=2e9,
        gpu_adam_params_per_s=1e10,
        host_s_per_tensor=1e-3,
    )
    return MachineRates(**{**base, **kw})
