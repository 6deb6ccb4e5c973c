"""Across ranks: chunk groups (gather, retain, drop, reduce), the collectives and their
post-mortem, the device mesh and group phases. Imports ``memory`` and ``chunks``."""
