"""Checkpoints: consolidated weights by param name, optimizer state, written atomically.

A checkpoint is a directory:

- ``model.safetensors`` (one rank) or ``model-0000r-of-0000W.safetensors`` shards plus
  ``model.safetensors.index.json`` (several ranks): fp32 weights under the model's own
  ``state_dict`` keys (tied params under each of their keys), loadable by
  ``model.load_state_dict`` and by transformers' ``from_pretrained``;
- ``optimizer-0000r-of-0000W.safetensors``: ``<name>.exp_avg`` and ``<name>.exp_avg_sq``;
- ``hybridps.json``: format version, world size, precision, every param's shape and step
  count, param-group hyper-parameters, loss scaler, engine step, LR scheduler and the
  caller's own state.

Each rank writes only the chunks it owns, so nothing is gathered on one rank, and because
everything is keyed by param name a checkpoint written by N ranks loads into M ranks (each
reads what its own chunks cover). Writing goes to ``<dir>.partial``; only when every file
is complete is it swapped in place of ``<dir>`` (the previous checkpoint is kept as
``<dir>.old`` during the swap and used if a crash hits between the two renames), so a crash
never leaves a half checkpoint where a good one was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridps.client.chunk import ChunkKind
from hybridps.common.errors import ConfigError

if TYPE_CHECKING:
    from hybridps.engine import Engine

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META = "hybridps.json"


def _shard(prefix: str, rank: int, world: int) -> str:
    if world == 1 and prefix == "model":
        return "model.safetensors"
    return f"{prefix}-{rank + 1:05d}-of-{world:05d}.safetensors"


def _keys_by_param(engine: Engine) -> tuple[dict[int, list[str]], dict[str, torch.Tensor]]:
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


def save_checkpoint(engine: Engine, path: str | os.PathLike, *, lr_scheduler: Any = None, client_state: dict | None = None) -> None:
    """Write a checkpoint of ``engine`` to directory ``path`` (every rank calls this)."""
    client = engine.client
    groups = client.groups
    rank, world = client.rank, client.world_size
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    if groups is not None:
        groups.comm.barrier(what="checkpoint directory")
    keys, buffers = _keys_by_param(engine)
    optimizer = engine.optimizer
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, torch.Tensor] = {}
    steps: dict[str, int] = {}
    for info in client.params:
        if not client.owns(info.chunk):
            continue
        value = client.read_param(info.param).contiguous()
        for key in keys.get(id(info.param), [info.name]):
            weights[key] = value if key == keys[id(info.param)][0] else value.clone()
        step = optimizer.steps[info.slot.index]
        steps[info.name] = step
        if step:
            states[f"{info.name}.exp_avg"] = optimizer._read(ChunkKind.MOMENTUM, info).contiguous()
            states[f"{info.name}.exp_avg_sq"] = optimizer._read(ChunkKind.VARIANCE, info).contiguous()
    if rank == 0:
        for key, buf in buffers.items():
            weights[key] = buf.detach().to("cpu", copy=True).contiguous()
    model_file = _shard("model", rank, world)
    save_file(weights, str(partial / model_file), metadata={"format": "pt"})
    save_file(states, str(partial / _shard("optimizer", rank, world)), metadata={"format": "pt"})
    shard_info = ({k: model_file for k in weights}, sum(v.numel() * v.element_size() for v in weights.values()), steps)
    everyone = groups.comm.all_gather_object(shard_info, what="checkpoint index") if groups is not None else [shard_info]
    if rank == 0:
        weight_map: dict[str, str] = {}
        all_steps: dict[str, int] = {}
        total = 0
        for wmap, size, st in everyone:
            weight_map.update(wmap)
            all_steps.update(st)
            total += size
        if world > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        meta = {
            "format": FORMAT_VERSION,
            "world_size": world,
            "precision": client.config.precision,
            "params": {i.name: {"shape": list(i.shape), "step": all_steps.get(i.name, 0)} for i in client.params},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params" and _jsonable(v)}, "params": [client.param_info(p).name for p in g["params"]]}
                for g in optimizer.param_groups
            ],
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "engine": {"global_step": engine.global_step},
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "client_state": client_state,
        }
        (partial / META).write_text(json.dumps(meta, indent=2, default=_json_default))
        for f in partial.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(partial)
    if groups is not None:
        groups.comm.barrier(what="checkpoint files written")
    if rank == 0:
        _swap_in(partial, final)
    if groups is not None:
        groups.comm.barrier(what="checkpoint in place")
    logger.info("checkpoint written to %s", final)


def _swap_in(partial: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    partial.rename(final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


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
    """The checkpoint directory to read: ``path``, or ``path.old`` if a crash hit a swap."""
    final = Path(path)
    if (final / META).exists():
        return final
    old = final.with_name(final.name + ".old")
    if (old / META).exists():
        return old
    raise ConfigError(f"no checkpoint at {final} (no {META}); pass the directory that save_checkpoint wrote")


def load_checkpoint(engine: Engine, path: str | os.PathLike, *, lr_scheduler: Any = None) -> dict | None:
    """Load a checkpoint written by any number of ranks; return the saved ``client_state``.

    Every name, shape and dtype is checked before anything is written.
    """
    client = engine.client
    src = resolve(path)
    meta = json.loads((src / META).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {src} has format {meta.get('format')!r}; this HybridPS reads format {FORMAT_VERSION}")
    keys, buffers = _keys_by_param(engine)
    if (src / "model.safetensors.index.json").exists():
        weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    else:
        weight_map = {}
        with safe_open(str(src / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
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
        problems.append(f"{len(meta['param_groups'])} param groups in the checkpoint, {len(engine.optimizer.param_groups)} in the optimizer")
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
    opt_files = [f for f in os.listdir(src) if f.startswith("optimizer-")]
    opt_keys: dict[str, str] = {}
    for f in opt_files:
        with safe_open(str(src / f), framework="pt") as h:
            opt_keys.update({k: f for k in h.keys()})
    with torch.no_grad():
        for info in client.params:
            if info.slot.index not in values:
                continue
            client.write_param(info.param, values[info.slot.index])
            step = int(saved_params[info.name]["step"])
            optimizer.steps[info.slot.index] = step
            if step:
                for suffix, kind in ((".exp_avg", ChunkKind.MOMENTUM), (".exp_avg_sq", ChunkKind.VARIANCE)):
                    optimizer._write(kind, info, tensor(opt_keys[info.name + suffix], info.name + suffix))
        for key, buf in buffers.items():
            if key in weight_map:
                buf.copy_(tensor(weight_map[key], key))
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
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
