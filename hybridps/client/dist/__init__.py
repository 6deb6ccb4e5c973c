"""Between the ranks: the collectives with their watchdog and post-mortem (``comm.py``), the
mesh of shard groups and replicas (``mesh.py``), and the chunk groups that gather and reduce
chunks across a shard group (``groups.py``, ``group_phase.py``). Imports ``memory`` and
``chunks``."""
