"""Attention on the meta device: ``F.scaled_dot_product_attention`` saving for backward what
a real run's fused kernels save, while the planner simulates and only then.

Owns ``meta_attention_as_flash()``, the one place the planner changes how torch computes.
``simulation.simulate`` enters it around the simulated iterations (forward, backward, step);
nothing is changed at import or outside that block.

Does not own the models' attention (``hybridps.models.GPT`` calls
``F.scaled_dot_product_attention`` as any model does) or the measurement of activations (the
engine's tracer counts what autograd saves, whichever kernel saved it).

[Note: attention on the meta device]
``F.scaled_dot_product_attention`` on meta tensors falls back to the math kernel, which saves
the full (seq x seq) attention matrix in fp32 for backward. No real run does that: the CPU
and the CUDA fused kernels save q, k, v, the output and a log-sum-exp. So while the planner
simulates, meta inputs are sent to the CPU flash kernel's meta function, which saves what a
real run saves. Without this, planned activations of a GPT would be 10-40% too high at small
sizes and far too high at long sequences.

[Note: a scoped replacement of the function, not a TorchFunctionMode]
A torch function mode would be scoped by construction, but modes are thread-local and
autograd runs the backward of meta tensors on a device thread of its own: with activation
checkpointing the recomputed forward then takes the math kernel while the first forward took
the flash one, and torch.utils.checkpoint refuses the mismatch (tried; the planner's
checkpointed cases fail). So the block replaces the attribute ``F.scaled_dot_product_attention``,
which every thread sees, and is scoped in time instead:

- the replacement is installed when the outermost block is entered and the original is put
  back when the outermost block is left, whether it ends normally or by an exception;
- blocks nest, and may be open in several threads at once: a count under a lock keeps one
  replacement installed while any block is open, and only the last one out restores;
- the replacement hands every call on real tensors (and the meta calls the flash kernel does
  not take: not 4-D, or grouped-query heads that do not divide) to the original unchanged, so
  other threads computing while a block is open compute exactly as before;
- a model that bound the function by name before the block (``from torch.nn.functional
  import scaled_dot_product_attention``) is not covered and plans with the math kernel's
  larger activations.

[Note: grouped-query attention on meta]
Models with fewer key/value heads than query heads (Llama 3, Qwen2, Mistral) call the function
with ``enable_gqa=True`` and k, v of their own heads (Hugging Face's sdpa attention does so
whenever there is no mask). The fused kernels of a real run take such k, v as they are and save
them unexpanded; the math kernel would save the (seq x seq) matrix instead. The flash kernel's
meta function computes its shapes from the query, so it is given k, v as they come, and
backward gives their grads in their own shapes: saved are q, k and v of their own heads, the
output and the log-sum-exp, as the CUDA flash kernel saves them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

_SDPA_LOCK = threading.Lock()
#: open blocks (in every thread) and the function they replaced
_sdpa_state: dict[str, Any] = {"depth": 0, "original": None}


@contextlib.contextmanager
def meta_attention_as_flash() -> Iterator[None]:
    """Within this block, ``F.scaled_dot_product_attention`` on meta tensors saves for
    backward what the fused kernels of a real run save; on leaving the outermost block, by
    any way, the original is back (see the notes of this module)."""
    with _SDPA_LOCK:
        if _sdpa_state["depth"] == 0:
            original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _flash_on_meta(original)
            _sdpa_state["original"] = original
        _sdpa_state["depth"] += 1
    try:
        yield
    finally:
        with _SDPA_LOCK:
            _sdpa_state["depth"] -= 1
            if _sdpa_state["depth"] == 0:
                F.scaled_dot_product_attention = _sdpa_state["original"]
                _sdpa_state["original"] = None


def _flash_on_meta(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``original``, except that 4-D meta inputs go to the CPU flash kernel's meta function."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.is_meta and query.dim() == 4 and (not enable_gqa or _grouped_heads(query, key, value)):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    return attention


def _grouped_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Grouped-query attention the flash kernel takes as it is: 4-D key and value with the
    same heads, a divisor of the query's ([Note: grouped-query attention on meta])."""
    if key.dim() != 4 or value.dim() != 4 or key.size(-3) != value.size(-3) or key.size(-3) == 0:
        return False
    return query.size(-3) % key.size(-3) == 0
