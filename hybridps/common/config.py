"""``Config``: every knob of a HybridPS client, validated once, frozen afterwards.

Owns defaults, units and the checks that need no model (names, ranges, a capacity smaller
than one chunk). Checks that need the model (the smallest capacity a module can run in) live
with the layout in the client.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridps.common.devices import SIMULATE_MODES, canonical_device_name, parse_capacity
from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EVICTIONS = ("auto", "lru", "opt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Configuration of one HybridPS client (one per data-parallel rank).

    Capacities take bytes or strings with units ("256MiB", "2GiB"). See docs/CONFIG.md for
    the reference of every field.
    """

    #: "fp32", "fp16" (dynamic loss scaling) or "bf16". Master weights are fp32 in every mode.
    precision: str = "fp32"
    #: Memory HybridPS may use per device, e.g. {"cuda:0": "8GiB", "cpu": "64GiB"}. On a GPU
    #: the activations share this capacity (tidal budget). "cpu" defaults to available RAM;
    #: a visible GPU defaults to most of its free memory. Empty = every visible GPU + CPU
    #: (with several ranks: this rank's GPU). "cuda:local" names the GPU of this rank
    #: (cuda:LOCAL_RANK), so one config serves every rank of a node.
    devices: Mapping[str, int | str | None] = dataclasses.field(default_factory=dict)
    #: True: simulate a listed cuda:N that is not visible; False: require real GPUs;
    #: "always": simulate every listed GPU; "meta": simulate every device with no memory
    #: behind it (capacity planning: sizes and moves are real, values are not).
    simulate: bool | str = True
    #: Elements per chunk; None chooses one from the model (and the compute capacity).
    chunk_size: int | None = None
    #: Store each grad in its param's own slot after backward (14 B/param in fp16). Forbids
    #: gradient accumulation; set False to accumulate (16 B/param).
    grad_reuse: bool = True
    #: None: embedded in-process manager. "auto" or an endpoint ("ipc://...", "tcp://...")
    #: : the node's hybridps-manager daemon.
    manager: str | None = None
    #: Bytes kept free on the compute device at every moment, on top of the traced
    #: non-model memory.
    margin: int | str = 0
    #: Offsets of tensors inside chunks are multiples of this many elements.
    alignment: int = 8
    #: Eviction: "lru", "opt" (furthest next use from the warm-up trace) or "auto" (opt once a
    #: trace exists, lru before).
    eviction: str = "auto"
    #: fp16 loss scaling: a fixed scale, or None for dynamic scaling.
    static_loss_scale: float | None = None
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_factor: float = 2.0
    loss_scale_backoff_factor: float = 0.5
    loss_scale_growth_interval: int = 2000
    min_loss_scale: float = 1.0
    #: Record a warm-up trace on the first training iteration (tidal budget, eviction).
    trace: bool = True
    #: Moments to look ahead in the trace for chunks to bring early (0 = no prefetch).
    prefetch_window: int = 2
    #: Step a chunk's Adam as soon as all its grads are final, during backward (overlaps the
    #: optimizer with the rest of backward; same results). Needs grad_reuse=True, no fp16
    #: (overflow is only known when every grad is in) and no clip_grad_norm_ (the global norm
    #: is only known then too). engine.step() steps what is left.
    overlap_step: bool = False
    #: Host memory kept in freed chunk buffers for reuse (pinned when a real GPU computes);
    #: None = four of the largest chunks.
    pool_bytes: int | str | None = None
    #: Cap on pinned (page-locked) host memory for param and grad chunks that cross to a real
    #: GPU; beyond it host chunks are pageable. None = a quarter of the CPU capacity.
    pinned_bytes: int | str | None = None
    #: Record chunk events and the memory history from the start (export_trace, plot_memory);
    #: ``engine.record(True)`` turns it on later.
    record: bool = False
    #: Multi-rank: start every rank from rank 0's initial weights (as DDP does).
    sync_module_states: bool = True
    #: Multi-rank: how long a rank waits for the others at a collective before it fails
    #: naming the ranks that did not arrive.
    collective_timeout_s: float = 300.0
    #: Multi-rank: bytes of other ranks' chunks kept gathered after the forward used them,
    #: so backward need not gather them again (the last groups of the forward come first in
    #: backward). None = 10% of the compute device's capacity; the ranks agree on the least.
    live_gathered_bytes: int | str | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if not isinstance(self.devices, Mapping):
            raise ConfigError(f"devices={self.devices!r} must be a mapping such as {{'cuda:0': '8GiB'}}")
        devices: dict[str, int | None] = {}
        for name, cap in self.devices.items():
            canon = canonical_device_name(name)
            if canon in devices:
                raise ConfigError(f"devices lists {canon} twice (as {name!r}); keep one entry")
            devices[canon] = parse_capacity(canon, cap)
        object.__setattr__(self, "devices", types.MappingProxyType(devices))
        if self.simulate not in SIMULATE_MODES:
            raise ConfigError(f"simulate={self.simulate!r}; use True (simulate missing GPUs), False, 'always' or 'meta'")
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
                raise ConfigError(f"chunk_size={self.chunk_size!r} must be a positive number of elements, or None")
            chunk_bytes = self.chunk_size * self.param_dtype.itemsize
            for name, cap in devices.items():
                if name != "cpu" and cap is not None and cap < chunk_bytes:
                    raise ConfigError(
                        f"{name} capacity {format_bytes(cap)} ({cap} B) is smaller than one chunk: chunk_size="
                        f"{self.chunk_size} elements x {self.param_dtype.itemsize} B = {chunk_bytes} B; raise the "
                        f"capacity or lower chunk_size"
                    )
        if not isinstance(self.grad_reuse, bool):
            raise ConfigError(f"grad_reuse={self.grad_reuse!r} must be True or False")
        if self.manager is not None and not isinstance(self.manager, str):
            raise ConfigError(f"manager={self.manager!r}; use None (embedded), 'auto' or an endpoint string")
        object.__setattr__(self, "margin", parse_bytes(self.margin, what="margin"))
        if self.live_gathered_bytes is not None:
            object.__setattr__(self, "live_gathered_bytes", parse_bytes(self.live_gathered_bytes, what="live_gathered_bytes"))
        if self.pinned_bytes is not None:
            object.__setattr__(self, "pinned_bytes", parse_bytes(self.pinned_bytes, what="pinned_bytes"))
        if self.pool_bytes is not None:
            object.__setattr__(self, "pool_bytes", parse_bytes(self.pool_bytes, what="pool_bytes"))
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int) or self.alignment < 1:
            raise ConfigError(f"alignment={self.alignment!r} must be a positive number of elements")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction={self.eviction!r}; use one of {', '.join(EVICTIONS)}")
        _positive("initial_loss_scale", self.initial_loss_scale)
        _positive("min_loss_scale", self.min_loss_scale)
        if self.static_loss_scale is not None:
            _positive("static_loss_scale", self.static_loss_scale)
        if not (self.loss_scale_growth_factor > 1.0):
            raise ConfigError(f"loss_scale_growth_factor={self.loss_scale_growth_factor!r} must be > 1")
        if not (0.0 < self.loss_scale_backoff_factor < 1.0):
            raise ConfigError(f"loss_scale_backoff_factor={self.loss_scale_backoff_factor!r} must be in (0, 1)")
        _positive("collective_timeout_s", self.collective_timeout_s)
        if self.overlap_step and not self.grad_reuse:
            raise ConfigError("overlap_step=True needs grad_reuse=True: with accumulation a chunk's grads are final only at the step")
        if self.overlap_step and self.precision == "fp16":
            raise ConfigError(
                "overlap_step=True cannot be used with precision='fp16': whether to skip a step for an overflow is known "
                "only when every grad is in; use bf16 or fp32, or overlap_step=False"
            )
        if isinstance(self.prefetch_window, bool) or not isinstance(self.prefetch_window, int) or self.prefetch_window < 0:
            raise ConfigError(f"prefetch_window={self.prefetch_window!r} must be a number of moments >= 0 (0 turns prefetch off)")
        if not isinstance(self.loss_scale_growth_interval, int) or self.loss_scale_growth_interval < 1:
            raise ConfigError(f"loss_scale_growth_interval={self.loss_scale_growth_interval!r} must be a positive int")

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the param (and grad) chunks: what forward and backward compute in."""
        return PRECISIONS[self.precision]

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    # -- files -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "the config") -> Config:
        """A Config from a mapping of field names; an unknown name is refused with the
        closest valid one."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source} must be a mapping of Config fields, not {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in fields:
                close = difflib.get_close_matches(str(key), sorted(fields), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(sorted(fields))}"
                raise ConfigError(f"{source}: unknown field {key!r}{hint}")
        return cls(**dict(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Config:
        """A Config from a JSON (``.json``) or TOML (``.toml``) file of field names; a TOML
        file may keep them under a ``[hybridps]`` table."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p}: no such file")
        text = p.read_text()
        if p.suffix == ".json":
            try:
                values = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config file {p}: not valid JSON ({exc})") from None
        elif p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ConfigError(f"config file {p}: TOML needs Python >= 3.11; use a .json file") from None
            try:
                values = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {p}: not valid TOML ({exc})") from None
            values = values.get("hybridps", values)
        else:
            raise ConfigError(f"config file {p}: use a .json or .toml file")
        return cls.from_dict(values, source=f"config file {p}")

    @classmethod
    def from_deepspeed(cls, ds: Mapping[str, Any] | str | os.PathLike, **overrides: Any) -> Config:
        """The Config a DeepSpeed config (mapping or JSON file) means here; ``overrides`` win.
        The loop's settings (clipping, batch sizes, optimizer) and the ignored fields with
        their reasons: ``hybridps.common.deepspeed_config.translate``, whose ``describe()``
        lists them; they are also logged here."""
        from hybridps.common.deepspeed_config import translate

        result = translate(ds, **overrides)
        for key, why in result.ignored:
            logger.info("DeepSpeed config: %s ignored (%s)", key, why)
        if result.training:
            logger.info("DeepSpeed config: for the training loop: %s", result.training)
        return result.config

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (capacities in bytes), as ``from_dict`` takes them."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["devices"] = dict(self.devices)
        return out

    def to_file(self, path: str | os.PathLike) -> None:
        """Write the fields as JSON; ``from_file`` reads them back to an equal Config."""
        p = Path(path)
        if p.suffix != ".json":
            raise ConfigError(f"{p}: Config.to_file writes JSON; name the file *.json")
        p.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number")
