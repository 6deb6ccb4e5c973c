"""Reference models built on plain PyTorch (tests, benchmarks, `hybridps train`); ``hf``: a
Hugging Face causal LM from a local config (``hybridps train`` and ``hybridps plan``)."""

from hybridps.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
