"""Unmaterialized params: what a registered param is, and does, while its value lives only in chunks.

Owns the class a released param takes (``ChunkedParameter``), the table of what every torch op
on such a param means, and the read-only grad that ``param.grad`` shows for a grad kept in a
chunk. Does not own where values live or how they move (the client and its chunk manager) nor
which module is running (the hooks): it asks a ``ParamGuard``'s collaborators for those.

[Note: no silent placeholder]
Outside its accesses a param's ``.data`` is an empty tensor. Without care any op on it would
compute on nothing (``state_dict`` wrote empty tensors, ``p.clamp_`` edited nothing, ``p.grad``
was None so ``clip_grad_norm_`` clipped nothing). A released param therefore changes class to
``ChunkedParameter`` (the same move ``torch.nn.UninitializedParameter`` makes when it is
materialized, in reverse) whose ``__torch_function__`` sees every op on it:

- metadata (``shape``, ``size()``, ``numel()``, ``dim()``, ``dtype``, ``device``,
  ``requires_grad``) is answered from the registry without touching a chunk;
- inside a module's forward (a param used by a module other than its own, such as a tied head
  ``F.linear(h, emb.weight)``, ``nn.MultiheadAttention``'s ``out_proj.weight``, DeBERTa's
  relative embeddings) the param is accessed for the running module, the op computes on its
  real values, and the hooks remember the use so later iterations access (and prefetch) it
  with the module's own params;
- outside forward, on one rank, a read computes on a copy of the full-precision value (so
  ``model.state_dict()``, ``torch.save``, ``save_pretrained``, EMA updates and logging see the
  real weights) and an in-place op is applied to such a copy and written through to the master
  copy and the compute-precision copy (``load_state_dict``, ``nn.init.*_``, ``p.clamp_``);
  a differentiable read keeps the autograd path: its grad is added to the param's grad;
- anything else (``p.data`` outside forward, an in-place edit during forward, a read of another
  rank's chunk) raises a ``HybridPSError`` that names the param and the fix.

The swap costs two attribute stores per access on the hot path, and the module hooks access a
module's params before its forward runs, so ops inside forward never reach
``__torch_function__`` after the first iteration. (A ``__torch_dispatch__`` wrapper subclass
would see ops later, below autograd, and every op on an accessed param would pay for it.)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hybridps.client.chunks.read_only import ReadOnlyCopy, mutates, op_name, written_arg
from hybridps.common.errors import HybridPSError, StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ParamInfo
    from hybridps.client.params.running_forward import RunningForward
    from hybridps.common.devices import DeviceSpec


class ParamValues(Protocol):
    """What the guard asks of the holder of the params' values (the client's value API)."""

    compute: DeviceSpec
    world_size: int

    def param_info(self, param: torch.Tensor) -> ParamInfo: ...
    def read_value(self, param: nn.Parameter) -> torch.Tensor: ...
    def write_value(self, param: nn.Parameter, value: torch.Tensor) -> None: ...
    def grad_value(self, param: nn.Parameter) -> torch.Tensor | None: ...
    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None: ...
    def drop_grad(self, param: nn.Parameter) -> None: ...


#: id(param) -> the guard of the client that holds it
_GUARDS: dict[int, ParamGuard] = {}

#: in-place ops that change what a tensor *is* (its storage, shape or autograd identity)
_STRUCTURAL = frozenset(
    {
        "set_",
        "resize_",
        "resize_as_",
        "detach_",
        "as_strided_",
        "squeeze_",
        "unsqueeze_",
        "t_",
        "transpose_",
        "swapdims_",
        "swapaxes_",
        "rename_",
        "share_memory_",
    }
)
#: ops whose answer depends on the shape alone
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "is_contiguous", "__len__"})
#: property getters that produce tensors from the values
_VALUE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
#: ops that answer from the object alone
_IDENTITY = frozenset(
    {
        "__hash__",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "_is_view",
        "is_floating_point",
        "is_complex",
        "get_device",
    }
)


def guard_of(param: torch.Tensor) -> ParamGuard | None:
    return _GUARDS.get(id(param))


def _what(param: torch.Tensor, unknown: str) -> str:
    """The param's description for a message, or ``unknown`` once its client let it go."""
    guard = _GUARDS.get(id(param))
    return guard.describe(param) if guard else unknown


class ChunkedParameter(nn.Parameter):
    """The class of a registered param whose value is in chunks only (see the module note)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    @property
    def data(self):
        guard = _GUARDS.get(id(self))
        if guard is None:  # a stray placeholder (its client closed without restoring)
            raise StateError("this param's client is closed and did not give it its value back")
        return guard.data_of(self)

    @data.setter
    def data(self, value):
        if value is self:  # Module._apply after a conversion that left the param as it is (module_conversion)
            return
        raise HybridPSError(
            f"{_what(self, 'this param')}: assigning .data outside forward would detach it from its chunks (the value would be lost "
            f"at the next step). Set its value with param.copy_(value) under torch.no_grad(), "
            f"model.load_state_dict(...), or inside engine.gathered_parameters([param], modify=True)"
        )

    def __repr__(self) -> str:
        return f"HybridPS {_what(self, 'param')}: in chunks (read it with engine.gathered_parameters or model.state_dict())"

    def __deepcopy__(self, memo):
        """A deep copy is an ordinary Parameter holding the value (``copy.deepcopy(model)``
        for an EMA or a frozen reference model)."""
        if id(self) in memo:
            return memo[id(self)]
        guard = _GUARDS[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            requires_grad = self.requires_grad
        result = nn.Parameter(guard.read(self, torch.device("cpu")), requires_grad=requires_grad)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto):
        raise HybridPSError(
            f"pickling {_what(self, 'a HybridPS param')}: its value is in chunks. Save model.state_dict() (or engine.save_checkpoint) "
            f"instead of pickling the model or its params"
        )


GRAD_SCALER_MESSAGE = (
    "an enabled torch GradScaler steps an optimizer under HybridPS: it unscales param.grad in place and hands "
    "its scale to the step, while HybridPS keeps grads in chunks and scales the loss itself. Build the GradScaler "
    "with enabled=False (or drop it) and, for fp16, give hybridps.Config(precision='fp16') and call "
    "engine.backward(loss) instead of scaler.scale(loss).backward()"
)


class ReadOnlyGrad(ReadOnlyCopy):
    """What ``param.grad`` shows for a grad kept in a chunk: a copy of the (unscaled) grad
    (``torch.nn.utils.clip_grad_norm_`` on it would compute the right norm and clip nothing)."""

    _hybridps_what = "the grad of a param"
    _hybridps_fix = (
        "Clip with engine.clip_grad_norm_(max_norm) (not torch.nn.utils.clip_grad_norm_), drop grads with engine.zero_grad()"
    )
    _hybridps_drop: Callable[[], None] | None = None  # drops the grad it copies

    @classmethod
    def _refusal(cls, func, copies: list[ReadOnlyCopy]) -> HybridPSError | None:
        if getattr(func, "__name__", "") == "zero_" and len(copies) == 1 and copies[0]._hybridps_drop:
            # model.zero_grad(set_to_none=False): the grad is dropped (a later backward starts from none)
            copies[0]._hybridps_drop()
            return None
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            return HybridPSError(GRAD_SCALER_MESSAGE)
        return super()._refusal(func, copies)


def _inits_without_grad(func) -> bool:
    """``torch.nn.init`` functions write under ``torch.no_grad()`` themselves."""
    return getattr(func, "__module__", "") == "torch.nn.init"


_CONVERSION_DTYPES = {"half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}


def _conversion_target(op: str, args, kwargs) -> tuple[torch.dtype | None, torch.device | None]:
    """(dtype, device) a conversion asks for; None where it keeps the tensor's."""
    if op in _CONVERSION_DTYPES:
        return _CONVERSION_DTYPES[op], None
    if op == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        return dtype, None if device is None else torch.device(device)
    if op == "type":
        target = args[1] if len(args) > 1 else kwargs.get("dtype")
        if isinstance(target, torch.dtype):
            return target, None
        return None, None  # a tensor-type name: no module conversion passes one
    if op == "empty_like":
        return None, None
    return None, torch.device(op)  # cuda, cpu, xpu, mps


#: conversions ``Module.to``/``cuda``/``cpu``/``half``/``float``/``to_empty``... apply to each param
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "xpu", "mps", "half", "float", "double", "bfloat16", "type", "empty_like"})
_MODULE_APPLY_CODE = nn.Module._apply.__code__


def _from_module_apply() -> bool:
    """Whether the op being dispatched was called by ``nn.Module._apply`` (a conversion of a whole
    module), not by code reading a param (``w = p.to("cpu")`` wants a copy of its value)."""
    frame = sys._getframe(2)
    for _ in range(4):  # __torch_function__ -> the conversion's lambda -> Module._apply
        if frame is None:
            return False
        if frame.f_code is _MODULE_APPLY_CODE:
            return True
        frame = frame.f_back
    return False


def _dispatch(func, args, kwargs):
    name = getattr(func, "__name__", "")
    if name in _CONVERSIONS and args and id(args[0]) in _GUARDS and _from_module_apply():
        return _GUARDS[id(args[0])].module_conversion(name, args, kwargs)
    if name == "__get__" or name == "__set__":
        prop = getattr(func.__self__, "__name__", "")
        param = args[0]
        guard = _GUARDS.get(id(param))
        if guard is not None and prop not in _VALUE_PROPERTIES:
            return guard.property_get(param, prop) if name == "__get__" else guard.property_set(param, prop, args[1])
    elif name in _SHAPE_METHODS and args and id(args[0]) in _GUARDS:
        guard = _GUARDS[id(args[0])]
        return func(guard.shadow(args[0]), *args[1:], **kwargs)
    elif name in _IDENTITY:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    elif name == "requires_grad_":  # a change is honoured at the next forward (hooks.sync_requires_grad)
        with torch._C.DisableTorchFunctionSubclass():
            func(*args, **kwargs)
        return args[0]
    leaves = pytree.tree_leaves((args, kwargs))
    targets = [t for t in leaves if isinstance(t, ChunkedParameter)]
    if not targets:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if any(id(t) not in _GUARDS for t in targets):
        raise StateError(
            f"{op_name(func)} on a param whose HybridPS client was closed with restore=False: it has no value any more; "
            f"close engines with restore=True (the default) to keep the model usable"
        )
    guard = _GUARDS[id(targets[0])]
    return guard.apply(func, args, kwargs, targets)


def placeholders(device: torch.device) -> Callable[[torch.dtype], torch.Tensor]:
    """One empty tensor per dtype on ``device``, made at its first use: the ``.data`` of every
    registered param (and managed tensor) of that dtype while it is not accessed."""

    @functools.cache
    def placeholder(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=device)

    return placeholder


class ParamGuard:
    """The meaning of ops on one client's unmaterialized params.

    A param that an op of a running forward needs is lent to that forward by ``forward``
    (running_forward.py), which the module hooks enter and leave; outside a forward it lends
    nothing and the op takes the paths below.
    """

    def __init__(self, client: ParamValues, forward: RunningForward, placeholder: Callable[[torch.dtype], torch.Tensor]):
        """``client``: the holder of the params' values, asked when an op is applied;
        ``placeholder``: the empty tensor of a dtype on the compute device (``placeholders``)."""
        self.client = client
        #: the module forwards under way, which a param an op needs is lent to
        self.forward = forward
        #: the empty tensor of a dtype that a released param's ``.data`` is (one per dtype)
        self.placeholder = placeholder
        self._shadows: dict[int, torch.Tensor] = {}
        #: while a state_dict is taken: id(param) -> the copy already read (one tensor per tied param)
        self._read_cache: dict[int, torch.Tensor] | None = None
        #: module conversions seen (model.to/cuda/cpu/float: see [Note: converting a model under HybridPS])
        self.conversions = 0

    def begin_read_cache(self) -> None:
        """A state_dict is being taken: a tied param is read once, as one tensor."""
        self._read_cache = {}

    def end_read_cache(self) -> None:
        """No copy read before may be handed out again (the state_dict ended, values change,
        or a forward starts after a state_dict cut short by an error)."""
        self._read_cache = None

    # -- the class swap (hot path) ---------------------------------------------------------

    def adopt(self, info: ParamInfo) -> None:
        _GUARDS[id(info.param)] = self
        info.cls = type(info.param)

    def forget(self, info: ParamInfo) -> None:
        _GUARDS.pop(id(info.param), None)
        self._shadows.pop(id(info.param), None)

    @staticmethod
    def materialize(info: ParamInfo, value: torch.Tensor) -> None:
        param = info.param
        param.__class__ = info.cls
        param.data = value

    @staticmethod
    def unmaterialize(info: ParamInfo, placeholder: torch.Tensor) -> None:
        param = info.param
        param.__class__ = info.cls
        param.data = placeholder
        param.__class__ = ChunkedParameter

    # -- answers ---------------------------------------------------------------------------

    def info(self, param: nn.Parameter) -> ParamInfo:
        return self.client.param_info(param)

    def describe(self, param: nn.Parameter) -> str:
        return self.info(param).describe()

    def shadow(self, param: nn.Parameter) -> torch.Tensor:
        """A meta tensor of the param's real shape and compute dtype (for shape questions)."""
        shadow = self._shadows.get(id(param))
        if shadow is None:
            info = self.info(param)
            with torch._C.DisableTorchFunctionSubclass():
                dtype = param.dtype
            shadow = self._shadows[id(param)] = torch.empty(info.shape, dtype=dtype, device="meta")
        return shadow

    def property_get(self, param: nn.Parameter, prop: str):
        if prop == "shape":
            return self.info(param).shape
        if prop == "ndim":
            return len(self.info(param).shape)
        if prop == "nbytes":
            return self.shadow(param).nbytes
        with torch._C.DisableTorchFunctionSubclass():
            value = getattr(param, prop)
        if prop == "grad" and value is None:
            return self.client_grad(param)
        return value

    def property_set(self, param: nn.Parameter, prop: str, value) -> None:
        if prop == "grad":
            if value is not None:
                raise HybridPSError(
                    f"setting .grad of {self.describe(param)}: HybridPS keeps grads in chunks and fills them in "
                    f"backward; compute the grad inside forward/backward, or drop grads with engine.zero_grad()"
                )
            self.client.drop_grad(param)
        with torch._C.DisableTorchFunctionSubclass():
            setattr(param, prop, value)

    def client_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        value = self.client.grad_value(param)
        if value is None:
            return None
        grad = value.as_subclass(ReadOnlyGrad)
        grad._hybridps_what = f"the grad of {self.describe(param)}"
        grad._hybridps_drop = lambda: self.client.drop_grad(param)
        return grad

    def data_of(self, param: nn.Parameter) -> torch.Tensor:
        if self.forward.borrow(param):
            return param.data
        raise HybridPSError(
            f"{self.describe(param)}.data outside forward: its value lives in HybridPS chunks, and an edit of a "
            f"copy would be lost. Read or edit it inside `with engine.gathered_parameters([param], modify=True):`, "
            f"or use param ops directly (param.clamp_(...) under torch.no_grad() writes through; "
            f"model.state_dict() reads)"
        )

    def read(self, param: nn.Parameter, device: torch.device) -> torch.Tensor:
        """A copy of the full-precision value (in the param's original dtype) on ``device``."""
        self._check_single_rank(param, "reading")
        return self.client.read_value(param).to(device)

    # -- ops -------------------------------------------------------------------------------

    def apply(self, func, args, kwargs, targets: list[nn.Parameter]):
        op = op_name(func)
        target_ids = {id(t) for t in targets}
        writes = mutates(func, args, kwargs, lambda t: id(t) in target_ids)
        if getattr(func, "__name__", "") in _STRUCTURAL:
            raise HybridPSError(
                f"{op} on {self.describe(targets[0])}: HybridPS owns this param's storage and cannot let it be "
                f"replaced or reshaped in place; build a new model or edit values with copy_"
            )
        if self.forward.borrow(targets[0]):  # inside a forward: compute on the real values
            if writes:
                raise HybridPSError(
                    f"in-place {op} on {self.describe(targets[0])} during forward: the edit would reach the "
                    f"compute copy only and be lost at the next step (the fp32 master is the truth). Edit weights "
                    f"between steps, e.g. with torch.no_grad(): param.{op}(...)"
                )
            for t in targets[1:]:
                if not self.forward.borrow(t):
                    raise StateError(f"{self.describe(t)}: could not be accessed for {op}")
            return func(*args, **kwargs)
        return self._apply_outside(func, op, args, kwargs, targets, writes)

    def _apply_outside(self, func, op, args, kwargs, targets, writes):
        device = (
            torch.device("cpu")
            if op in ("detach", "cpu", "numpy", "tolist", "__reduce_ex__")
            else self.client.compute.torch_device
        )
        grad_enabled = torch.is_grad_enabled()
        copies: dict[int, torch.Tensor] = {}
        cache = self._read_cache if op == "detach" and not writes else None
        for t in targets:
            if id(t) in copies:
                continue
            if cache is not None and id(t) in cache:
                copies[id(t)] = cache[id(t)]
                continue
            value = self.read(t, device)
            if cache is not None:
                cache[id(t)] = value
            with torch._C.DisableTorchFunctionSubclass():
                needs_grad = t.requires_grad
            if grad_enabled and needs_grad and not _inits_without_grad(func):
                if writes:
                    raise HybridPSError(
                        f"in-place {op} on {self.describe(t)}, a leaf that requires grad, with grad enabled "
                        f"(plain PyTorch refuses this too): wrap the edit in torch.no_grad()"
                    )
                if op != "detach":
                    value.requires_grad_(True)
                    value.register_post_accumulate_grad_hook(self._grad_through_copy(t))
            copies[id(t)] = value
        new_args, new_kwargs = pytree.tree_map(
            lambda x: copies.get(id(x), x) if isinstance(x, ChunkedParameter) else x, (args, kwargs)
        )
        result = func(*new_args, **new_kwargs)
        if writes:
            self._read_cache = None  # values change: no copy read before may be handed out again
            written = {id(t) for t in pytree.tree_leaves(written_arg(func, args, kwargs)) if id(t) in copies}
            if kwargs.get("out") is not None:
                written |= {id(t) for t in pytree.tree_leaves(kwargs["out"]) if id(t) in copies}
            with torch.no_grad():
                for t in targets:
                    if id(t) in written:
                        self.client.write_value(t, copies[id(t)])
                        written.discard(id(t))
            back = {id(v): k for k, v in copies.items()}
            if isinstance(result, torch.Tensor) and id(result) in back:
                return next(t for t in targets if id(t) == back[id(result)])
        return result

    # [Note: converting a model under HybridPS]
    # ``model.to(device)``, ``.cuda()``, ``.cpu()`` and ``.float()`` run ``nn.Module._apply``,
    # which converts each param and either sets ``param.data`` to the result or, where the
    # result's tensor type differs (another device type), replaces the param in its module by a
    # new Parameter: a param HybridPS no longer knows, which would then compute as a frozen
    # copy and never train. So a conversion called by ``Module._apply`` leaves a registered param
    # as it is (the model data stays where HybridPS placed it; the engine moves inputs to the
    # compute device) and ``_apply`` then sets ``param.data`` to the param itself, a no-op. A
    # conversion that would change a param's dtype (``.half()``, ``.to(torch.bfloat16)``) or move
    # it to the meta device (``to_empty``) is refused with the fix: the compute precision is
    # ``Config.precision``. A param's own ``p.to(...)``, ``p.cpu()`` outside ``_apply`` still gives
    # a copy of its value.

    def module_conversion(self, op: str, args, kwargs) -> nn.Parameter:
        param = args[0]
        info = self.info(param)
        dtype, device = _conversion_target(op, args, kwargs)
        what = f"model.{op}(...)" if op != "empty_like" else "model.to_empty(...)"
        if op == "empty_like" or (device is not None and device.type == "meta"):
            raise HybridPSError(
                f"{what} after hybridps.initialize on {info.describe()}: its value lives in HybridPS chunks and would be "
                f"thrown away. Build the model on the meta device before initialize (hybridps.meta_init(), or "
                f"engine.load_pretrained for its weights)"
            )
        self.conversions += 1  # the engine puts the buffers back on the compute device at the next forward
        if dtype is not None and dtype != info.orig_dtype:
            raise HybridPSError(
                f"{what} after hybridps.initialize would make {info.describe()} {dtype}: HybridPS keeps {info.orig_dtype} "
                f"master weights and computes in the precision of its Config. Give hybridps.Config(precision='bf16') "
                f"(or 'fp16') instead of converting the model"
            )
        return param

    def _grad_through_copy(self, param: nn.Parameter):
        def hook(copy: torch.Tensor) -> None:
            grad = copy.grad
            copy.grad = None
            if grad is not None:
                self.client.add_grad(param, grad)

        return hook

    def _check_single_rank(self, param: nn.Parameter, doing: str) -> None:
        if self.client.world_size > 1:
            raise HybridPSError(
                f"{doing} {self.describe(param)} outside forward with {self.client.world_size} ranks: its chunk lives "
                f"on one rank only. On every rank together use engine.state_dict() / engine.load_state_dict(), or "
                f"`with engine.gathered_parameters([...]):` to read or edit values"
            )
