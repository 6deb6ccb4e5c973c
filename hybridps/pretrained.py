"""Pretrained weights streamed from safetensors files into a model under HybridPS.

Owns reading a Hugging Face pretrained folder (``model.safetensors``, or shards listed by
``model.safetensors.index.json``; a single ``.safetensors`` file works too), matching its
tensor names to the model's ``state_dict`` keys, checking every name, shape and dtype before
anything is written, and writing tensor by tensor into the chunks each rank keeps.

Does not own HybridPS checkpoints (checkpoint.py: optimizer state, steps, loss scale) or
where values live (the client).

[Note: memory while loading]
Files are opened with ``safe_open`` (memory-mapped); the check reads only their headers.
Then each param this rank keeps is read alone, written into its master and compute copies,
and dropped, so loading holds one tensor beyond the chunks, never a state dict. With several
ranks each rank reads only the tensors of the chunks it owns: every rank calls this (no
collective is needed, since every rank reads the same files).

[Note: names]
A name matches a ``state_dict`` key as is, or across Hugging Face's base-model prefix (weights
of ``GPT2Model`` load into ``GPT2LMHeadModel`` under ``transformer.`` and the reverse). A tied
param has several keys; any one of them in the files gives its value. Params that the files
lack are an error with ``strict=True`` (the default) and keep their values otherwise; names in
the files that the model lacks are logged and skipped, as ``from_pretrained`` does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open

from hybridps.common.errors import ConfigError

if TYPE_CHECKING:
    from hybridps.client.client import Client


class EngineParts(Protocol):
    """What loading reads of an engine (``hybridps.engine.Engine``). A protocol, so this module
    does not import the engine, whose ``load_pretrained`` calls it."""

    module: torch.nn.Module
    client: Client


logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass
class LoadReport:
    """What ``load_pretrained`` did on this rank."""

    files: list[str]
    loaded_params: int  # params whose values this rank wrote (its own chunks)
    loaded_buffers: int
    missing: list[str]  # model keys the files lack (strict=False only)
    unexpected: list[str]  # names in the files the model lacks
    read_bytes: int  # bytes of tensors this rank read


def weight_files(path: str | os.PathLike) -> tuple[Path, dict[str, str]]:
    """The folder (or file) ``path`` and its tensor name -> file map."""
    src = Path(path)
    if src.is_file():
        if src.suffix != ".safetensors":
            raise ConfigError(f"{src} is not a .safetensors file; pass a pretrained folder or a .safetensors file")
        with safe_open(str(src), framework="pt") as f:
            return src.parent, {k: src.name for k in f.keys()}
    if (src / INDEX).exists():
        weight_map = json.loads((src / INDEX).read_text())["weight_map"]
        return src, dict(weight_map)
    if (src / SINGLE).exists():
        with safe_open(str(src / SINGLE), framework="pt") as f:
            return src, {k: SINGLE for k in f.keys()}
    found = sorted(p.name for p in src.glob("*")) if src.is_dir() else []
    raise ConfigError(
        f"no safetensors weights at {src} (looked for {SINGLE} and {INDEX}; found {found[:8]}); pass the folder "
        f"save_pretrained wrote. PyTorch .bin checkpoints are not read: convert them with save_pretrained"
        f"(safe_serialization=True)"
    )


#: what a peft adapter wrapper adds to the names of the base model's params
_PEFT_PREFIX = "base_model.model."
_PEFT_BASE_LAYER = ".base_layer."


def _unwrapped(key: str) -> str:
    """The base model's name of ``key`` in a peft-wrapped model: LoRA moves a wrapped
    layer's weight to ``<layer>.base_layer.weight`` under ``base_model.model.``; a base
    checkpoint names it ``<layer>.weight``."""
    if key.startswith(_PEFT_PREFIX):
        key = key[len(_PEFT_PREFIX) :]
    return key.replace(_PEFT_BASE_LAYER, ".")


def _match(names: dict[str, str], model_keys: list[str], prefix: str) -> dict[str, str]:
    """model key -> name in the files, for the keys the files hold (see [Note: names])."""
    out: dict[str, str] = {}
    for key in model_keys:
        for candidate in dict.fromkeys((key, _unwrapped(key))):
            if candidate in names:
                out[key] = candidate
            elif prefix and candidate.startswith(prefix + ".") and candidate[len(prefix) + 1 :] in names:
                out[key] = candidate[len(prefix) + 1 :]
            elif prefix and f"{prefix}.{candidate}" in names:
                out[key] = f"{prefix}.{candidate}"
            if key in out:
                break
    return out


def load_pretrained(engine: EngineParts, path: str | os.PathLike, *, strict: bool = True) -> LoadReport:
    """Load the weights at ``path`` into ``engine``'s model (every rank calls this)."""
    client = engine.client
    folder, names = weight_files(path)
    state = engine.module.state_dict(keep_vars=True)
    prefix = getattr(engine.module, "base_model_prefix", "") or ""
    matched = _match(names, list(state), prefix)
    keys_of: dict[int, list[str]] = {}
    buffers: list[str] = []
    for key, value in state.items():
        if client.is_registered(value):
            keys_of.setdefault(id(value), []).append(key)
        else:
            buffers.append(key)
    with ExitStack() as stack:
        files = _OpenWeights(
            {f: stack.enter_context(safe_open(str(folder / f), framework="pt")) for f in sorted(set(names.values()))}, names
        )
        source, missing, problems = _check_params(client, keys_of, matched, files)
        problems += _check_buffers(buffers, state, matched, files)
        if strict and missing:
            problems.append(
                f"{len(missing)} params are not in the files: {missing[:5]}{' ...' if len(missing) > 5 else ''} (strict=False keeps their values)"
            )
        if problems:
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
            raise ConfigError(f"weights at {folder} do not match the model; nothing was loaded:\n  " + "\n  ".join(shown))
        used = set(matched.values())
        unexpected = sorted(n for n in names if n not in used)
        if unexpected:
            logger.warning("%d tensors at %s are not in the model and were skipped: %s", len(unexpected), folder, unexpected[:5])
        with torch.no_grad():
            loaded, read_bytes = _write_params(client, source, files)
            loaded_buffers = _write_buffers(engine.module, state, buffers, matched, files, client.compute.torch_device)
    logger.info("loaded %d params (%d bytes) and %d buffers from %s", loaded, read_bytes, loaded_buffers, folder)
    return LoadReport(
        files=sorted(set(names.values())),
        loaded_params=loaded,
        loaded_buffers=loaded_buffers,
        missing=missing,
        unexpected=unexpected,
        read_bytes=read_bytes,
    )


@dataclasses.dataclass(frozen=True)
class _OpenWeights:
    """The open safetensors files of a pretrained folder (file name -> ``safe_open`` handle)
    and the file holding each tensor name; headers are read without reading tensors."""

    handles: dict[str, Any]
    names: dict[str, str]

    def file_of(self, name: str) -> str:
        return self.names[name]

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        """Shape and safetensors dtype (``"F32"``, ...) of tensor ``name``, from its header."""
        piece = self.handles[self.names[name]].get_slice(name)
        return tuple(piece.get_shape()), piece.get_dtype()

    def tensor(self, name: str) -> torch.Tensor:
        return self.handles[self.names[name]].get_tensor(name)


def _check_params(
    client: Client, keys_of: dict[int, list[str]], matched: dict[str, str], files: _OpenWeights
) -> tuple[dict[int, str], list[str], list[str]]:
    """Each registered param's name in the files, checked by shape and dtype before anything
    is written: (registration index -> name, the model keys the files lack, the problems)."""
    source: dict[int, str] = {}  # registration index -> name in the files
    missing: list[str] = []
    problems: list[str] = []
    for info in client.params:
        keys = keys_of.get(id(info.param), [info.name])
        name = next((matched[k] for k in keys if k in matched), None)
        if name is None:
            missing.append(keys[0])
            continue
        shape, dtype = files.meta(name)
        if shape != tuple(info.shape):
            problems.append(f"{keys[0]}: shape {shape} in {files.file_of(name)}, {tuple(info.shape)} in the model")
        elif dtype not in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"):
            problems.append(f"{keys[0]}: dtype {dtype} in {files.file_of(name)} is not floating point")
        else:
            source[info.slot.index] = name
    return source, missing, problems


def _check_buffers(buffers: list[str], state: dict[str, torch.Tensor], matched: dict[str, str], files: _OpenWeights) -> list[str]:
    """The buffers (``state`` keys not registered with the client) whose shape in the files differs."""
    problems = []
    for key in buffers:
        if key in matched:
            shape, _ = files.meta(matched[key])
            if shape != tuple(state[key].shape):
                problems.append(f"{key}: shape {shape} in {files.file_of(matched[key])}, {tuple(state[key].shape)} in the model")
    return problems


def _write_params(client: Client, source: dict[int, str], files: _OpenWeights) -> tuple[int, int]:
    """Write each param of the chunks this rank owns from the files, one tensor read at a
    time (see [Note: memory while loading]): (params written, bytes read)."""
    loaded = read_bytes = 0
    for info in client.params:
        name = source.get(info.slot.index)
        if name is None or not client.owns(info.chunk):
            continue
        value = files.tensor(name)
        read_bytes += value.numel() * value.element_size()
        client.write_param(info.param, value)
        loaded += 1
        del value
    return loaded, read_bytes


def _write_buffers(
    module: torch.nn.Module,
    state: dict[str, torch.Tensor],
    buffers: list[str],
    matched: dict[str, str],
    files: _OpenWeights,
    device: torch.device,
) -> int:
    """Copy the matched buffers from the files (a buffer built on the meta device gets a
    tensor on ``device``); the number written."""
    loaded_buffers = 0
    for key in buffers:
        if key in matched:
            value = files.tensor(matched[key])
            if state[key].is_meta:  # a buffer built on the meta device gets its tensor
                owner, _, name = key.rpartition(".")
                module.get_submodule(owner)._buffers[name] = value.to(device=device, dtype=state[key].dtype)
            else:
                state[key].copy_(value)
            loaded_buffers += 1
    return loaded_buffers
