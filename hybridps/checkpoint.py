"""Checkpoints: consolidated weights by param name, optimizer state, written atomically.

A checkpoint is a directory:

- ``model.safetensors`` (one rank) or ``model-0000r-of-0000W.safetensors`` shards plus
  ``model.safetensors.index.json`` (several ranks): fp32 weights under the model's own
  ``state_dict`` keys (tied params under each of their keys), loadable by
  ``model.load_state_dict`` and by transformers' ``from_pretrained``;
- ``optimizer-0000r-of-0000W.safetensors``: ``<name>.exp_avg`` and ``<name>.exp_avg_sq`` (fp32),
  or under compact states their codes and block scales (``<name>.exp_avg.codes``,
  ``<name>.exp_avg.scales``, ...; see [Note: compact states saved]);
- ``hybridps.json``: format version, world size, precision, every param's shape and step
  count, param-group hyper-parameters, loss scaler, engine step, LR scheduler and the
  caller's own state.

Each rank writes only the chunks it owns, so nothing is gathered on one rank, and because
everything is keyed by param name a checkpoint written by N ranks loads into M ranks (each
reads what its own chunks cover). A rank writes its files a param at a time
(common/safetensors_stream.py, [Note: a checkpoint streamed]): the host holds one param's
values beside its chunks, never the shard's.

[Note: crash safety]
A save may die at any instruction, and the next save may die too: the newest complete
checkpoint must stay loadable. So:

- a directory is *complete* when its ``hybridps.json`` exists (and every shard it names):
  that file is written last, as ``hybridps.json.tmp`` renamed into place after every other
  file is fsynced, and it carries a ``generation`` one above the newest complete copy;
- writing goes to ``<dir>.partial``; the swap renames ``<dir>`` to ``<dir>.old``, then
  ``<dir>.partial`` to ``<dir>``, then throws ``<dir>.old`` away;
- nothing is deleted in place: a directory is first renamed to ``<dir>.trash`` (atomic)
  and only then removed, so a crash mid-removal never leaves a half directory under a
  name that is read;
- every save starts (rank 0) by finishing what a crashed one left (``recover``): the
  newest complete copy among ``<dir>``, ``<dir>.partial`` and ``<dir>.old`` is renamed to
  ``<dir>``, and only copies that are incomplete or older are thrown away, one rename at
  a time, so the newest complete copy always exists under one of the three names;
- loading reads the newest complete copy among the three names, and logs a warning when it
  is not ``<dir>`` itself.

Every filesystem change of a save passes ``_fs_step`` first, where a test injects a crash.

[Note: compact states saved]
Under ``Config.optimizer_states="int8"`` a moment is saved as it is kept: the codes and block
scales of the param's own blocks (every param starts on a block boundary, so its blocks hold
nothing else: common/optimizer_states.py), so a save and a load change no bit, whatever the
number of ranks on either side. A load takes either form into either kind of run: codes into a
compact run as they are, codes into an exact run dequantized (what the int8 run stepped with),
fp32 moments into a compact run quantized; so a run moves from exact to compact states at a
resume, or back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim import adam_state
from hybridps.client.optim.moment_codes import dequantize_codes
from hybridps.common.errors import ConfigError
from hybridps.common.safetensors_stream import SafetensorsWriter, header_room

if TYPE_CHECKING:
    from hybridps.client.client import Client
    from hybridps.client.optim.adam import ChunkedAdam
    from hybridps.client.optim.loss_scaler import LossScaler
    from hybridps.client.optim.optimizer_part import OptimizerPart


#: a moment's key suffix in the optimizer files and the row it is kept in
MOMENT_SUFFIXES = ((".exp_avg", ChunkKind.MOMENTUM), (".exp_avg_sq", ChunkKind.VARIANCE))
#: what follows a moment's key for its codes and block scales (see [Note: compact states saved])
CODES_SUFFIX, SCALES_SUFFIX = ".codes", ".scales"


class EngineParts(Protocol):
    """What a checkpoint reads and restores of an engine (``hybridps.engine.Engine``). A
    protocol, so this module does not import the engine, whose save and load methods call it."""

    module: torch.nn.Module
    client: Client
    optimizer: ChunkedAdam
    scaler: LossScaler | None
    global_step: int


logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META = "hybridps.json"

#: called with a description before every filesystem change of a save; tests raise here to
#: simulate a crash at that point (None in production)
crash_hook: Callable[[str], None] | None = None


def _fs_step(what: str) -> None:
    if crash_hook is not None:
        crash_hook(what)


def _shard(prefix: str, rank: int, world: int) -> str:
    if world == 1 and prefix == "model":
        return "model.safetensors"
    return f"{prefix}-{rank + 1:05d}-of-{world:05d}.safetensors"


def _keys_by_param(engine: EngineParts) -> tuple[dict[int, list[str]], dict[str, torch.Tensor]]:
    """state_dict keys of every registered param (a tied param has several), and the buffers."""
    keys: dict[int, list[str]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if engine.client.is_registered(value):
            keys.setdefault(id(value), []).append(key)
        else:
            buffers[key] = value
    return keys, buffers


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    engine: EngineParts, path: str | os.PathLike, *, lr_scheduler: Any = None, client_state: dict | None = None
) -> None:
    """Write a checkpoint of ``engine`` to directory ``path`` (every rank calls this)."""
    client = engine.client
    groups = client.groups
    rank = client.rank
    # one shard file per rank of a shard group, written by the first replica: the other
    # replicas own the same chunks with the same values (hybrid sharding, sharding/mesh.py)
    shard, world = client.shard_layout.shard_rank, client.shard_size
    writes = client.shard_layout.replica == 0
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        recover(final)  # finish what a crashed save left, keeping the newest complete copy
        generation = max((_generation(d) for d in _copies(final).values() if _complete(d)), default=0) + 1
        _trash(partial)
        _fs_step(f"mkdir {partial}")
        partial.mkdir(parents=True)
    if groups is not None:
        groups.everyone.barrier(what="checkpoint directory")
    keys, buffers = _keys_by_param(engine)
    model_file = _shard("model", shard, world)
    weights: dict[str, str] = {}
    weight_bytes, steps, values = 0, {}, {}
    if writes:  # each tensor written as it is read ([Note: a checkpoint streamed])
        files = _open_shards(client, partial, keys, buffers if rank == 0 else {}, model_file, _shard("optimizer", shard, world))
        try:
            steps, values = _write_owned(client, engine.optimizer, keys, *files)
            if rank == 0:
                for key, buf in buffers.items():
                    files[0].add(key, buf)
            for f in files:
                f.close()
        except BaseException:
            for f in files:
                f.abandon()
            raise
        weights, weight_bytes = dict.fromkeys(files[0].entries, model_file), files[0].nbytes
    shard_info = (weights, weight_bytes, steps, values)
    everyone = groups.everyone.all_gather_object(shard_info, what="checkpoint index") if groups is not None else [shard_info]
    if rank == 0:
        if world > 1:
            _write_index(partial, everyone)
        meta = _meta(engine, everyone, world=world, generation=generation, lr_scheduler=lr_scheduler, client_state=client_state)
        _commit(partial, meta)
    if groups is not None:
        groups.everyone.barrier(what="checkpoint files written")
    if rank == 0:
        _swap_in(partial, final)
    if groups is not None:
        groups.everyone.barrier(what="checkpoint in place")
    logger.info("checkpoint written to %s", final)


def _open_shards(
    client: Client,
    partial: Path,
    keys: dict[int, list[str]],
    buffers: dict[str, torch.Tensor],
    model_file: str,
    optimizer_file: str,
) -> tuple[SafetensorsWriter, SafetensorsWriter]:
    """This rank's model and optimizer files, open for writing, each with room for the header
    of what it will hold (its names known now, an optimizer's other states estimated)."""
    names = [k for info in client.params if client.owns(info.chunk) for k in keys.get(id(info.param), [info.name])]
    names += list(buffers)
    owned = [info.name for info in client.params if client.owns(info.chunk)]
    meta = {"format": "pt"}
    _fs_step(f"write {model_file}")
    model = SafetensorsWriter(partial / model_file, room_bytes=header_room(len(names), sum(map(len, names)), meta), metadata=meta)
    _fs_step(f"write {optimizer_file}")
    states = 4 * len(owned)  # Adam's two moments, as codes and scales under compact states
    room = header_room(states, 4 * sum(len(n) + len(CODES_SUFFIX) + len(".exp_avg_sq") for n in owned), meta)
    try:
        optimizer = SafetensorsWriter(partial / optimizer_file, room_bytes=room, metadata=meta)
    except BaseException:
        model.abandon()
        raise
    return model, optimizer


def _write_owned(
    client: Client, optimizer: ChunkedAdam, keys: dict[int, list[str]], weights: SafetensorsWriter, states: SafetensorsWriter
) -> tuple[dict[str, int], dict[str, dict]]:
    """Write the params this rank owns, one at a time: the fp32 weights under each of their
    ``state_dict`` keys, and the optimizer's states of each param that has taken a step;
    returns every owned param's step count, and the optimizer's states that are not tensors."""
    steps: dict[str, int] = {}
    #: an optimizer's states that are not tensors (a Python step count): into hybridps.json
    values: dict[str, dict] = {}
    for info in client.params:
        if not client.owns(info.chunk):
            continue
        value = client.read_param(info.param)
        for key in keys.get(id(info.param), [info.name]):
            weights.add(key, value)
        del value  # the host holds one param's values at a time
        step = optimizer.steps[info.slot.index]
        steps[info.name] = step
        part = optimizer.parts_by_param[info.slot.index]
        if part is not None and part.torch_step is not None:  # another optimizer's states, by torch's names
            for key, state in (optimizer.state_of(info) or {}).items():
                if torch.is_tensor(state):
                    states.add(f"{info.name}.{key}", state)
                elif _jsonable(state):
                    values.setdefault(info.name, {})[key] = state
                else:
                    raise ConfigError(
                        f"optimizer state {key!r} of {info.describe()} is a {type(state).__name__}, which a checkpoint "
                        f"cannot hold (tensors go to safetensors, numbers and strings to hybridps.json); keep it as a "
                        f"tensor or a number in optimizer.state[p]"
                    )
        elif step:
            for suffix, kind in MOMENT_SUFFIXES:
                if client.store.compact_moments:  # the codes themselves: lossless ([Note: compact states saved])
                    codes, scales = optimizer._read_codes(kind, info)
                    states.add(f"{info.name}{suffix}{CODES_SUFFIX}", codes)
                    states.add(f"{info.name}{suffix}{SCALES_SUFFIX}", scales)
                else:
                    states.add(f"{info.name}{suffix}", optimizer._read(kind, info))
    return steps, values


def _meta(
    engine: EngineParts, everyone: list, *, world: int, generation: int, lr_scheduler: Any, client_state: dict | None
) -> dict:
    """The content of ``hybridps.json``, from every rank's ``(weight map, bytes, steps)`` in ``everyone``."""
    client = engine.client
    all_steps: dict[str, int] = {}
    all_values: dict[str, dict] = {}
    for _, _, st, values in everyone:
        all_steps.update(st)
        all_values.update(values)
    return {
        "format": FORMAT_VERSION,
        "generation": generation,
        "world_size": world,
        "precision": client.config.precision,
        "optimizer_states": client.config.optimizer_states,
        "params": {
            i.name: {
                "shape": list(i.shape),
                "step": all_steps.get(i.name, 0),
                **({"state_values": all_values[i.name]} if i.name in all_values else {}),
            }
            for i in client.params
        },
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params" and _jsonable(v)},
                "params": [client.param_info(p).name for p in g["params"]],
            }
            for g in engine.optimizer.param_groups
        ],
        "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "engine": {"global_step": engine.global_step},
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "client_state": client_state,
    }


def _write_index(partial: Path, everyone: list) -> None:
    """``model.safetensors.index.json`` of a checkpoint written by several ranks: which shard
    holds each weight, from every rank's ``(weight map, bytes, steps)`` in ``everyone``."""
    weight_map: dict[str, str] = {}
    total = 0
    for wmap, size, _, _ in everyone:
        weight_map.update(wmap)
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _fs_step("write model.safetensors.index.json")
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _commit(partial: Path, meta: dict) -> None:
    """Make ``partial`` complete once every shard is in it (rank 0): ``hybridps.json``
    written aside and renamed into place after every file is fsynced, the commit point of
    [Note: crash safety]."""
    tmp = partial / (META + ".tmp")
    _fs_step(f"write {tmp.name}")
    tmp.write_text(json.dumps(meta, indent=2, default=_json_default))
    for f in partial.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fs_step(f"rename {tmp.name} to {META} (the commit point)")
    tmp.rename(partial / META)
    _fsync_dir(partial)


def _swap_in(partial: Path, final: Path) -> None:
    """Put the complete ``partial`` in place of ``final`` (see [Note: crash safety])."""
    old = final.with_name(final.name + ".old")
    _trash(old)  # recover() left none; a stale one is never newer than partial
    if final.exists():
        _fs_step(f"rename {final.name} to {old.name}")
        final.rename(old)
    _fs_step(f"rename {partial.name} to {final.name}")
    partial.rename(final)
    _fsync_dir(final.parent)
    _trash(old)


def _copies(final: Path) -> dict[str, Path]:
    """The names a checkpoint may be found under, in order of preference at equal generation."""
    return {
        "main": final,
        "partial": final.with_name(final.name + ".partial"),
        "old": final.with_name(final.name + ".old"),
    }


def _complete(d: Path) -> bool:
    """Whether ``d`` is a whole checkpoint: its hybridps.json (written last) and every shard
    that names exist."""
    try:
        meta = json.loads((d / META).read_text())
        world = int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    needed = [_shard("optimizer", r, world) for r in range(world)]
    needed += (
        ["model.safetensors"]
        if world == 1
        else ["model.safetensors.index.json"] + [_shard("model", r, world) for r in range(world)]
    )
    return all((d / f).is_file() for f in needed)


def _generation(d: Path) -> int:
    try:
        return int(json.loads((d / META).read_text()).get("generation", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def _newest_complete(final: Path) -> tuple[str, Path] | None:
    complete = [(kind, d) for kind, d in _copies(final).items() if _complete(d)]
    if not complete:
        return None
    order = list(_copies(final))
    # the highest generation; at equal generation (checkpoints older than generations) the main one
    return max(complete, key=lambda kd: (_generation(kd[1]), -order.index(kd[0])))


def _trash(d: Path) -> None:
    """Remove ``d``: renamed away first (atomic), so a crash never leaves half of it under ``d``."""
    if not d.exists():
        return
    trash = d.with_name(d.name + ".trash")
    if trash.exists():
        _fs_step(f"remove {trash.name}")
        shutil.rmtree(trash)
    _fs_step(f"rename {d.name} to {trash.name}")
    d.rename(trash)
    _fs_step(f"remove {trash.name}")
    shutil.rmtree(trash)


def recover(path: str | os.PathLike) -> Path | None:
    """Finish a save that crashed: make the newest complete copy ``path`` and throw away the
    rest (incomplete or older copies and trash). Returns ``path`` or None if no copy is whole.

    Each step is one rename or the removal of a copy that is not the newest complete one, so a
    crash at any point leaves the newest complete copy under one of the three names.
    """
    final = Path(path)
    copies = _copies(final)
    newest = _newest_complete(final)
    for kind in ("partial", "old"):  # everything that is not the newest complete copy
        if newest is None or newest[0] != kind:
            _trash(copies[kind])
    for d in (final.with_name(n.name + ".trash") for n in copies.values()):
        if d.exists():
            _fs_step(f"remove {d.name}")
            shutil.rmtree(d)
    if newest is None or newest[0] == "main":
        return final if newest is not None else None
    kind, src = newest
    logger.warning("checkpoint %s: a save crashed during its swap; putting its newest complete copy %s in place", final, src)
    if final.exists():  # incomplete, or older than src
        _trash(final)
    _fs_step(f"rename {src.name} to {final.name}")
    src.rename(final)
    _fsync_dir(final.parent)
    return final


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v, default=_json_default)
        return True
    except TypeError:
        return False


def _json_default(v: Any):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    raise TypeError(f"{type(v).__name__} is not JSON serialisable")


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory to read: the newest complete copy among ``path``,
    ``path.partial`` and ``path.old`` (the last two exist only after a crash during a save)."""
    final = Path(path)
    newest = _newest_complete(final)
    if newest is None:
        seen = [d.name for d in _copies(final).values() if d.exists()]
        found = f" ({', '.join(seen)} exist but are incomplete: a save crashed before writing {META})" if seen else ""
        raise ConfigError(
            f"no checkpoint at {final} (no complete copy with {META}){found}; pass the directory that save_checkpoint wrote"
        )
    kind, src = newest
    if kind != "main":
        why = "is missing" if not final.exists() else ("is incomplete" if not _complete(final) else f"is older than {src.name}")
        logger.warning("checkpoint %s %s (a save crashed during its swap); loading the newest complete copy, %s", final, why, src)
    return src


def load_checkpoint(engine: EngineParts, path: str | os.PathLike, *, lr_scheduler: Any = None) -> dict | None:
    """Load a checkpoint written by any number of ranks; return the saved ``client_state``.

    Every name, shape and dtype is checked before anything is written.
    """
    client = engine.client
    src = resolve(path)
    meta = json.loads((src / META).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {src} has format {meta.get('format')!r}; this HybridPS reads format {FORMAT_VERSION}")
    keys, buffers = _keys_by_param(engine)
    weight_map = _weight_map(src)
    saved_params = meta["params"]
    problems = _check_meta(engine, meta, keys, weight_map)
    handles: dict[str, Any] = {}

    def tensor(file: str, key: str) -> torch.Tensor:
        if file not in handles:
            handles[file] = safe_open(str(src / file), framework="pt")
        return handles[file].get_tensor(key)

    values: dict[int, torch.Tensor] = {}
    for info in client.params:
        if not client.owns(info.chunk) or any(p.startswith(info.name + ":") for p in problems):
            continue
        key = keys.get(id(info.param), [info.name])[0]
        if key not in weight_map:
            continue
        value = tensor(weight_map[key], key)
        if not value.is_floating_point():
            problems.append(f"{info.name}: dtype {value.dtype} in the checkpoint is not floating point")
        elif tuple(value.shape) != tuple(info.shape):
            problems.append(f"{info.name}: shape {tuple(value.shape)} in the checkpoint, {tuple(info.shape)} in the model")
        values[info.slot.index] = value
    if problems:
        raise ConfigError(f"checkpoint {src} does not match this model; nothing was loaded:\n  " + "\n  ".join(problems))
    optimizer = engine.optimizer
    opt_keys = _optimizer_keys(src)
    by_param = _states_by_param(opt_keys)
    with torch.no_grad():
        for info in client.params:
            if info.slot.index not in values:
                continue
            client.write_param(info.param, values[info.slot.index])
            step = int(saved_params[info.name]["step"])
            optimizer.steps[info.slot.index] = step
            part = optimizer.parts_by_param[info.slot.index]
            if part is not None and part.torch_step is not None:
                saved_values = saved_params[info.name].get("state_values", {})
                _load_states(optimizer, part, info, by_param.get(info.name, {}), saved_values, opt_keys, tensor)
            elif step:
                for suffix, kind in MOMENT_SUFFIXES:
                    _load_moment(client, optimizer, kind, info, info.name + suffix, opt_keys, tensor)
        for key, buf in buffers.items():
            if key in weight_map:
                buf.copy_(tensor(weight_map[key], key))
        for group, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
            for k, v in saved.items():
                if k != "params":
                    group[k] = tuple(v) if k == "betas" else v
    if meta.get("scaler") is not None and engine.scaler is not None:
        engine.scaler.load_state_dict(meta["scaler"])
    engine.global_step = int(meta["engine"]["global_step"])
    if lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(meta["lr_scheduler"])
    logger.info("checkpoint loaded from %s (written by %d ranks)", src, meta["world_size"])
    return meta.get("client_state")


def _load_states(
    optimizer: ChunkedAdam, part: OptimizerPart, info, saved: dict[str, str], values: dict, opt_keys: dict, tensor
) -> None:
    """An optimizer's states of one param, saved by torch's names (``<param>.<state>``;
    ``saved``: state name -> key; ``values``: its states that are not tensors, from
    hybridps.json), as its own step keeps them (optim/torch_step.py); a param without any
    starts afresh."""
    assert part.torch_step is not None
    entry = {name: tensor(opt_keys[key], key) for name, key in saved.items()}
    entry.update(values)
    part.torch_step.forget(info.slot.index)
    if entry:
        adam_state.write_entry(optimizer, info, entry, low_precision=False)


def _states_by_param(opt_keys: dict[str, str]) -> dict[str, dict[str, str]]:
    """A checkpoint's optimizer keys by param name: ``<param>.<state>`` -> {state: key} (a
    state name has no dot; a param's name cannot be another's with a dot added, as a module
    attribute is a param or a module, not both)."""
    out: dict[str, dict[str, str]] = {}
    for key in opt_keys:
        name, _, state = key.rpartition(".")
        out.setdefault(name, {})[state] = key
    return out


def _load_moment(client: Client, optimizer: ChunkedAdam, kind: ChunkKind, info, key: str, opt_keys: dict, tensor) -> None:
    """One moment of one param from the checkpoint, in whichever form it was saved: codes
    into a compact row as they are, codes into an fp32 row dequantized, fp32 values into
    either (quantized into a compact row). See [Note: compact states saved]."""
    if key + CODES_SUFFIX in opt_keys:
        codes = tensor(opt_keys[key + CODES_SUFFIX], key + CODES_SUFFIX)
        scales = tensor(opt_keys[key + SCALES_SUFFIX], key + SCALES_SUFFIX)
        if client.store.compact_moments:
            optimizer._write_codes(kind, info, codes, scales)
        else:
            signed = kind is ChunkKind.MOMENTUM
            values = dequantize_codes(codes, scales, signed=signed)[: info.slot.numel]
            optimizer._write(kind, info, values.view(info.shape))
        return
    optimizer._write(kind, info, tensor(opt_keys[key], key))


def _weight_map(src: Path) -> dict[str, str]:
    """Each weight's name in checkpoint ``src`` -> the file holding it."""
    if (src / "model.safetensors.index.json").exists():
        return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _optimizer_keys(src: Path) -> dict[str, str]:
    """Each optimizer state's name (``<param>.exp_avg``, ``<param>.exp_avg_sq``) in checkpoint ``src`` -> its file."""
    opt_keys: dict[str, str] = {}
    for f in [f for f in os.listdir(src) if f.startswith("optimizer-")]:
        with safe_open(str(src / f), framework="pt") as h:
            opt_keys.update({k: f for k in h.keys()})
    return opt_keys


def _check_meta(engine: EngineParts, meta: dict, keys: dict[int, list[str]], weight_map: dict[str, str]) -> list[str]:
    """What of the checkpoint's ``hybridps.json`` does not match the model, before any tensor
    is read: params missing or of another shape, params the model lacks, the number of
    param groups."""
    client = engine.client
    saved_params = meta["params"]
    problems = []
    for info in client.params:
        entry = saved_params.get(info.name)
        if entry is None:
            problems.append(f"{info.name}: not in the checkpoint")
        elif tuple(entry["shape"]) != tuple(info.shape):
            problems.append(f"{info.name}: shape {tuple(entry['shape'])} in the checkpoint, {tuple(info.shape)} in the model")
        elif keys.get(id(info.param), [info.name])[0] not in weight_map:
            problems.append(f"{info.name}: no weights in the checkpoint")
    extra = sorted(set(saved_params) - {i.name for i in client.params})
    if extra:
        problems.append(f"params in the checkpoint that the model lacks: {extra[:5]}")
    if len(meta["param_groups"]) != len(engine.optimizer.param_groups):
        problems.append(
            f"{len(meta['param_groups'])} param groups in the checkpoint, {len(engine.optimizer.param_groups)} in the optimizer"
        )
    return problems
