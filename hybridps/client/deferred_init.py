"""Meta-device init: build a model without memory, give it the values a CPU build would have.

Owns the record of what a model's construction does to its tensors (``meta_init()``) and the
replay of that record into the chunks of a registered model (``replay``, ``give_values``).
Does not own the chunks or the layout (the client) nor loading weights from files
(pretrained.py).

[Note: why record and replay]
Every rank building a 50B model in fp32 on the CPU before registering it needs 200 GB of host
memory per rank. Under ``with hybridps.meta_init():`` the model is built on the meta device
(no memory), and a ``TorchFunctionMode`` records, in order, every op of the construction that
creates a tensor or writes into one in place (``torch.empty``, ``nn.init.normal_``,
``kaiming_uniform_``, ``weight.data.zero_()``, ``weight[pad].fill_(0)``...), with the CPU
generator's state at the start. After registration, ``replay`` runs the same ops, in the same
order, from the same generator state, on real tensors one param at a time: each op on a param
reads the param's current value from its chunk, applies the op and writes the result back
(master and compute copies). The generator is consumed exactly as by a CPU build, so the values
are the same bit for bit, and at no point is more than one param (plus the temporaries the init
code itself makes) materialized. With several ranks every rank replays every op (the random
stream must be the same everywhere) and keeps what falls in its own chunks.

The generator is left where a CPU build would have left it; random numbers drawn between the
end of the ``with`` block and ``initialize`` are drawn again.

[Note: init on the GPU]
A CPU draws random numbers on one core (about 10^8 a second: a 13 B GPT, whose linear weights
are drawn twice, by ``nn.Linear``'s own init and again by the model's, spends about four
minutes in ``normal_`` and ``uniform_``). ``meta_init(device="cuda")`` records the GPU's
generator instead, and the replay runs the ops there: the factories make their tensors on that
GPU, a param's value is read from its chunk onto it and written back, and the values (and the
GPU's generator afterwards) are those of a build under ``with torch.device("cuda"):`` with the
same seed, bit for bit (the GPU's generator advances by the same offsets for the same ops on
the same shapes). The CPU's generator is not touched, as such a build would not touch it. At most
one param (and the init code's temporaries) lies on the GPU at a time.

Limits, each refused with a HybridPSError: a construction that draws random numbers on a real
device inside the block (an explicit ``device="cpu"``) would draw them at construction, out of
order; a param that is a view into a larger tensor; an op whose meta output cannot be replayed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._device import _device_constructors

from hybridps.client.chunks.read_only import written_arg
from hybridps.common.errors import HybridPSError

if TYPE_CHECKING:
    from hybridps.client.client import Client

logger = logging.getLogger(__name__)

#: storage key of every meta tensor a recording created -> that recording
_RECORDS: dict[int, MetaInitRecord] = {}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]  # meta outputs with a new storage
    writes: list[int]  # storage keys written in place


class MetaInitRecord(TorchFunctionMode):
    """The ops of one model's construction on the meta device (see the module note)."""

    def __init__(self, device: torch.device):
        super().__init__()
        #: where the ops replay and whose generator they draw from ([Note: init on the GPU])
        self.device = device
        self.ops: list[_Op] = []
        self.rng_state: torch.Tensor | None = None
        # tensors built from data (config constants) stay real: small, and they draw nothing
        self._factories = _device_constructors() - {torch.tensor, torch.as_tensor, torch.asarray}
        self._known: set[int] = set()
        self.replayed = False

    def __enter__(self):
        self.rng_state = _get_rng_state(self.device)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for key in self._known:
            _RECORDS[key] = self
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._factories and kwargs.get("device") is None:
            # what torch.device("meta") does, without making it the default device: code that
            # skips its init under a meta default device (Hugging Face's post_init) runs it here
            out = func(*args, **{**kwargs, "device": "meta"})
        else:
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__") or not _is_meta_call(args, kwargs, out):
            return out
        outputs = [t for t in pytree.tree_leaves(out) if _is_meta(t) and _key(t) not in self._known]
        writes = [_key(t) for t in pytree.tree_leaves(written_arg(func, args, kwargs)) if _is_meta(t)]
        if "out" in kwargs:
            writes += [_key(t) for t in pytree.tree_leaves(kwargs["out"]) if _is_meta(t)]
        if outputs or writes:
            # keep aliases, not the tensors: a param object leaves the meta device at registration
            alias = lambda x: x.detach() if _is_meta(x) else x  # noqa: E731
            args, kwargs = pytree.tree_map(alias, (args, kwargs))
            self.ops.append(_Op(func, args, kwargs, [t.detach() for t in outputs], writes))
            self._known.update(_key(t) for t in outputs)
        return out


def _is_meta_call(args, kwargs, out) -> bool:
    return any(_is_meta(t) for t in pytree.tree_leaves((args, kwargs, out)))


def meta_init(device: str | torch.device | None = None) -> MetaInitRecord:
    """``with hybridps.meta_init(): model = build()`` builds ``model`` on the meta device and
    records its init; ``hybridps.initialize(model, ...)`` then replays it into the chunks.

    ``device``: where the init runs at ``initialize`` and whose generator it draws from. None
    or ``"cpu"``: the values a CPU build gives. ``"cuda"`` (the current GPU) or ``"cuda:N"``:
    the values a build under ``with torch.device("cuda:N"):`` gives, drawn on that GPU in a
    fraction of the time ([Note: init on the GPU])."""
    return MetaInitRecord(_init_device(device))


def _init_device(device: str | torch.device | None) -> torch.device:
    """The device a recording replays on: the CPU, or a visible GPU with its index."""
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise HybridPSError(f"meta_init(device={device!r}): not a device ({exc}); use 'cpu' or 'cuda[:N]'") from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise HybridPSError(
            f"meta_init(device={device!r}): the init replays on the CPU or a CUDA GPU only; use 'cpu' or 'cuda[:N]'"
        )
    if not torch.cuda.is_available():
        raise HybridPSError(
            f"meta_init(device={device!r}): no CUDA device is visible to this process; build with "
            "meta_init() for a CPU build's values"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if not 0 <= index < torch.cuda.device_count():
        raise HybridPSError(
            f"meta_init(device={device!r}): this process sees {torch.cuda.device_count()} CUDA device(s); "
            f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", index)


def _get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


def record_of(module: torch.nn.Module) -> MetaInitRecord | None:
    """The recording the module's meta params came from, if any."""
    for p in module.parameters():
        if p.is_meta:
            return _RECORDS.get(_key(p))
    return None


def give_values(record: MetaInitRecord | None, client: Client, module: torch.nn.Module) -> set[int]:
    """Give the registered params built on the meta device their values: replay their recorded
    init (``record``), or leave them for load_pretrained. Returns the ids still without values."""
    metas = [i for i in client.params if i.meta_key is not None]
    if not metas:
        return set()
    if record is None:
        logger.info(
            "%d params were built on the meta device without meta_init(): load their weights with engine.load_pretrained",
            len(metas),
        )
        return {id(i.param) for i in metas}
    if client.groups is not None:  # every rank draws rank 0's random stream, as sync_module_states would give
        state = record.rng_state.clone()
        client.groups.everyone.broadcast(state, 0, what="meta_init generator state")
        record.rng_state = state
    touched = replay(record, client, module)
    device = client.compute.torch_device
    for buf in module.buffers():
        buf.data = buf.data.to(device)
    return {id(i.param) for i in metas if id(i.param) not in touched}


def replay(record: MetaInitRecord, client: Client, module: torch.nn.Module) -> set[int]:
    """Run ``record``'s ops on real tensors; params go to their chunks, buffers to the module.
    Returns the ids of the params that got values."""
    if record.replayed:
        raise HybridPSError("this meta_init recording was replayed already: build the model again under meta_init()")
    run = _Replay(record, client, module)
    device = record.device
    state = _get_rng_state(device)
    _set_rng_state(device, record.rng_state)
    try:
        for i, op in enumerate(record.ops):
            run.op(i, op)
        run.give_buffers_values()
    except BaseException:
        _set_rng_state(device, state)
        raise
    record.replayed = True
    for key in record._known:  # the meta tensors may go now; their addresses may be reused
        if _RECORDS.get(key) is record:
            del _RECORDS[key]
    return run.touched


class _Replay:
    """One replay of a recording into ``client``'s chunks and ``module``'s buffers: the real
    storage of each meta tensor while an op still reads it, and the params given values."""

    def __init__(self, record: MetaInitRecord, client: Client, module: torch.nn.Module):
        self.client = client
        self.device = record.device
        #: the factories a build under ``torch.device(self.device)`` would run there
        self.factories = record._factories
        #: storage key -> the registered param made from it
        self.params = {info.meta_key: info.param for info in client.params if info.meta_key is not None}
        #: storage key -> the (module, name) places of the meta buffers made from it
        self.buffers: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta:
                    self.buffers.setdefault(_key(buf), []).append((mod, name))
        #: storage key -> index of the last op that reads it (its real storage can go after)
        self.last_use: dict[int, int] = {}
        for i, op in enumerate(record.ops):
            for t in pytree.tree_leaves((op.args, op.kwargs)):
                if _is_meta(t):
                    self.last_use[_key(t)] = i
        self.real: dict[int, torch.Tensor] = {}  # storage key -> real flat storage, for non-param tensors
        self.touched: set[int] = set()
        #: params whose storage only an uninitialized factory (torch.empty) made so far: nothing
        #: is written to their chunks (which start zeroed) and a read gets fresh memory, as a CPU
        #: build would. [Note: fresh params] saves a write and a read-back of every param that
        #: is created empty and initialized by a later op, which is how nn modules build them.
        self.fresh: set[int] = set()

    def _real_of(self, t: Any, loaded: dict[int, torch.Tensor], op: _Op) -> Any:
        """The real tensor standing for ``t`` in ``op`` (``t`` itself unless it is meta); a
        param's value is read once per op into ``loaded``."""
        if not _is_meta(t):
            # a constant made from data (torch.tensor) lies where such a build would make it
            return t.to(self.device) if isinstance(t, torch.Tensor) and t.device != self.device else t
        key = _key(t)
        base = self.real.get(key)
        if base is None and key in self.params:
            base = loaded.get(key)
            if base is None and key in self.fresh:
                info = self.client.param_info(self.params[key])
                base = loaded[key] = torch.empty(info.shape.numel(), dtype=info.orig_dtype, device=self.device)
            elif base is None:
                base = loaded[key] = _param_value(self.client, self.params[key]).to(self.device)
        if base is None:
            raise HybridPSError(
                f"meta_init cannot replay {getattr(op.func, '__name__', op.func)}: it reads a meta tensor of shape "
                f"{tuple(t.shape)} that no recorded op created; build this model on the CPU"
            )
        return base.as_strided(t.size(), t.stride(), t.storage_offset())

    def op(self, i: int, op: _Op) -> None:
        """Run the ``i``-th recorded op on real tensors, write the params it made or wrote
        back to their chunks, and drop the storages no later op reads."""
        loaded: dict[int, torch.Tensor] = {}  # param storages read for this op
        args, kwargs = pytree.tree_map(lambda t: self._real_of(t, loaded, op), (op.args, op.kwargs))
        if str(kwargs.get("device", "")) == "meta" or (op.func in self.factories and kwargs.get("device") is None):
            # a factory (or an explicit meta device) makes its tensor on the replay's device
            kwargs = {**kwargs, "device": self.device}
        with torch.no_grad():
            out = op.func(*args, **kwargs)
        for meta_out, real_out in zip(
            op.outputs, [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)][: len(op.outputs)], strict=True
        ):
            key = _key(meta_out)
            flat = _storage_of(real_out)
            if key in self.params:
                loaded[key] = flat
            else:
                self.real[key] = flat
        uninitialized = getattr(op.func, "__name__", "") in _UNINITIALIZED_FACTORIES
        for key in set(op.writes) | {_key(t) for t in op.outputs}:
            if key in loaded:
                self.touched.add(id(self.params[key]))
                if uninitialized and key not in op.writes:
                    self.fresh.add(key)
                    continue
                self.fresh.discard(key)
                _write_param(self.client, self.params[key], loaded[key])
        for t in pytree.tree_leaves((op.args, op.kwargs)):
            if _is_meta(t) and self.last_use.get(_key(t)) == i and _key(t) not in self.buffers:
                self.real.pop(_key(t), None)

    def give_buffers_values(self) -> None:
        """Replace each meta buffer of the module by its replayed value."""
        for key, places in self.buffers.items():
            base = self.real.get(key)
            if base is None:
                raise HybridPSError(
                    f"buffer {places[0][1]!r} of {type(places[0][0]).__name__} was never given values in meta_init"
                )
            for mod, name in places:
                meta_buf = mod._buffers[name]
                mod._buffers[name] = base.as_strided(meta_buf.size(), meta_buf.stride(), meta_buf.storage_offset()).clone()


#: factories whose output holds no values yet (see [Note: fresh params] in ``_Replay``)
_UNINITIALIZED_FACTORIES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _storage_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat tensor of its dtype."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((numel,), (1,), 0)


def _param_value(client: Client, param: torch.nn.Parameter) -> torch.Tensor:
    info = client.param_info(param)
    if client.owns(info.chunk):
        return client.read_value(param).reshape(-1)  # a copy already
    return torch.zeros(info.shape.numel(), dtype=info.orig_dtype)  # another rank keeps it: draw, then drop


def _write_param(client: Client, param: torch.nn.Parameter, flat: torch.Tensor) -> None:
    info = client.param_info(param)
    if client.owns(info.chunk):
        client.write_param(param, flat[: info.shape.numel()].view(info.shape))
