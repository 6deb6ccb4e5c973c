"""Where chunks live and how they move: the mover (brings, evicts, books the daemon), placement
rules, the memory trace and its tracer, the host arena and pools, the simulated link and the
event recorder. Imports ``chunks`` only."""
