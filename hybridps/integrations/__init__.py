"""Integrations with the tools people train with (see docs/INTEGRATIONS.md)."""
