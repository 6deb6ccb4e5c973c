"""Between the ranks: the collectives (``collectives.py``) with their heartbeat watchdog
(``watchdog.py``) and the post-mortem of one that failed (``postmortem.py``), who is where
(``topology.py``, ``mesh.py``), and the chunk groups that gather and reduce chunks across a
shard group (``groups.py``; their gathers, ``gathers.py`` and ``group_phase.py``; their
reductions, ``reductions.py``). Imports ``memory`` and ``chunks``."""
