"""Integrations with the tools people train with (see docs/INTEGRATIONS.md)."""

#: the name PyTorch Lightning resolves to ``HybridPSStrategy``: ``Trainer(strategy="hybridps")``
LIGHTNING_STRATEGY = "hybridps"
