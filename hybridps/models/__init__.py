"""Reference models built on plain PyTorch (tests, benchmarks, `hybridps train`)."""

from hybridps.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
