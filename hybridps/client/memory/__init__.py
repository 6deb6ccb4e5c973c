"""Where chunks live and how they move: the mover (brings, evicts, books the daemon), placement
rules and the optimizer rows moved to the GPU, the memory trace and its tracer, the host arena
and pools, the host memory figures, the simulated link and the event recorder. Imports
``chunks`` only."""
