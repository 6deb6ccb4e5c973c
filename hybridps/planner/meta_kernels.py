"""Meta kernels remembered: while the planner simulates, an op on meta tensors that was seen
before with the same inputs' metadata gets fresh empty outputs of the metadata it gave then,
without running its meta kernel again.

Owns ``remembered_meta_kernels()``, the dispatch mode that does it, and the rules of what it
may remember (below). ``simulation.simulate`` enters it around building the model,
``initialize`` and the simulated iterations; nothing is changed outside that block or in
other threads.

Does not own what an op computes (its meta kernel does, once per distinct call), autograd,
or what the engine measures: the tensors a remembered op returns are the ones its kernel
would return (shape, strides, dtype, a storage of their own of the same bytes), so saved
activations, their storages, chunk payloads and every figure of a simulation are the same
with the block as without it (``tests/test_planner.py`` compares whole simulations).

[Note: why remember meta kernels]
A simulation's time goes into PyTorch's meta kernels, not into the engine: most of them are
Python decompositions (``torch._refs``, ``torch._prims``; a layer norm's meta kernel takes
about 5 ms on a 2-core VM, a linear 2 ms), run for every op of every block in the forward,
the recomputed forward and the backward of both iterations, and for the init of every
param. A model of the planned family repeats one block n_layer times, so nearly every call
repeats an earlier one exactly: the same op on inputs of the same shapes, strides and
dtypes. The output's metadata is a function of those alone (meta tensors have no values),
so it is computed once and remembered; a repeat costs a dictionary look-up and an empty
tensor. At d_model 2048 this halves a simulation (more with depth), which is what lets the
search for the largest model simulate models of thousands of layers.

[Note: what may be remembered]
Only calls whose every tensor is a plain strided meta tensor and whose other arguments are
plain values (numbers, strings, dtypes, devices, layouts, memory formats, and lists of these
and of tensors); anything else (a CPU tensor, a generator, a subclass that dispatches
itself) runs its kernel every time. Ops that return views of their inputs always run their
kernel (a view shares its base's storage: autograd and the engine's tracer tell storages
apart). The first call of each distinct key runs the kernel and checks its result before
anything is remembered, and the key is remembered as "run every time" when:

- an input's metadata or storage changed (``resize_``, ``set_``, an ``out=`` argument of
  another shape);
- an output is not a fresh plain strided meta tensor, one input itself (an in-place op's
  ``self``: remembered as "return that input"), or a number or None; or two outputs share a
  storage, or an output's storage is larger than its extent.

The key holds the default dtype too, which a factory op without a dtype reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: argument types that are values (their type is part of the key: 1, 1.0 and True promote differently)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
#: a key whose calls run their kernel every time
_RUN = object()
#: an op whose calls always run their kernel (views of their inputs, or not ATen)
_ALWAYS_RUN = object()


class _NotPlain(Exception):
    """An argument the key cannot hold."""


def _tensor_key(t: torch.Tensor) -> tuple:
    if not t.is_meta or t.layout is not torch.strided or type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
        raise _NotPlain
    if t.is_neg() or t.is_conj():
        raise _NotPlain
    return (t.dtype, t.shape, t.stride(), t.storage_offset())


def _arg_key(a: Any, tensors: list) -> Any:
    if isinstance(a, torch.Tensor):
        tensors.append(a)
        return _tensor_key(a)
    if type(a) in _VALUES:
        return (type(a), a)
    if type(a) in (list, tuple):
        return (type(a), tuple(_arg_key(x, tensors) for x in a))
    raise _NotPlain


def _state(tensors: list) -> list:
    """What an op must not change of its inputs for its call to be remembered."""
    return [(t.untyped_storage()._cdata, t.shape, t.stride(), t.storage_offset(), t.dtype) for t in tensors]


class _RememberedMetaKernels(TorchDispatchMode):
    """The dispatch mode of ``remembered_meta_kernels`` (see the module's notes)."""

    def __init__(self) -> None:
        super().__init__()
        #: key -> _RUN, or (whether the result is a sequence and its type, recipes of its items)
        self.remembered: dict[tuple, Any] = {}
        #: op -> _ALWAYS_RUN, or None (its calls may be remembered)
        self.ops: dict[Any, Any] = {}
        self.hits = 0
        self.runs = 0

    def _op_kind(self, func: Any) -> Any:
        kind = self.ops.get(func, self)
        if kind is self:
            schema = func._schema
            view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
            kind = _ALWAYS_RUN if view or func.namespace != "aten" else None
            self.ops[func] = kind
        return kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._op_kind(func) is _ALWAYS_RUN:
            return func(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        try:
            key = (
                func,
                torch.get_default_dtype(),
                tuple(_arg_key(a, tensors) for a in args),
                tuple((k, _arg_key(v, tensors)) for k, v in kwargs.items()),
            )
        except _NotPlain:
            return func(*args, **kwargs)
        recipe = self.remembered.get(key)
        if recipe is _RUN:
            return func(*args, **kwargs)
        if recipe is not None:
            self.hits += 1
            return _make(recipe, tensors)
        self.runs += 1
        before = _state(tensors)
        out = func(*args, **kwargs)
        self.remembered[key] = _recipe(out, tensors, before)
        return out


def _recipe(out: Any, tensors: list, before: list) -> Any:
    """How to make ``out`` again from inputs of the same metadata, or _RUN."""
    if _state(tensors) != before:
        return _RUN
    inputs = {s[0] for s in before}
    sequence = type(out) if type(out) in (list, tuple) else None
    items = out if sequence is not None else (out,)
    made, storages = [], set()
    for o in items:
        if isinstance(o, torch.Tensor):
            same = next((i for i, t in enumerate(tensors) if t is o), None)
            if same is not None:
                made.append(("input", same))
                continue
            if type(o) is not torch.Tensor or not o.is_meta or o.layout is not torch.strided or o.is_neg() or o.is_conj():
                return _RUN
            storage = o.untyped_storage()._cdata
            if storage in inputs or storage in storages or o.storage_offset() != 0 or o.requires_grad:
                return _RUN
            storages.add(storage)
            fresh = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta")
            if fresh.untyped_storage().nbytes() != o.untyped_storage().nbytes():
                return _RUN
            made.append(("new", tuple(o.shape), o.stride(), o.dtype))
        elif type(o) in _VALUES:
            made.append(("value", o))
        else:
            return _RUN
    return (sequence, tuple(made))


def _make(recipe: tuple, tensors: list) -> Any:
    sequence, made = recipe
    items = []
    for r in made:
        if r[0] == "new":
            items.append(torch.empty_strided(r[1], r[2], dtype=r[3], device="meta"))
        elif r[0] == "input":
            items.append(tensors[r[1]])
        else:
            items.append(r[1])
    return items[0] if sequence is None else sequence(items)


@contextlib.contextmanager
def remembered_meta_kernels() -> Iterator[_RememberedMetaKernels]:
    """Within this block (in this thread, and in autograd's when it runs this thread's
    backward), ops on meta tensors run their meta kernel once per distinct call and give
    fresh outputs of the same metadata on repeats (see the notes of this module)."""
    mode = _RememberedMetaKernels()
    with mode:
        yield mode
