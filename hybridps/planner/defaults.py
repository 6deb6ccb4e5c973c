"""The planner's defaults, without torch: the command line's parser reads them in every
``hybridps`` command (``hybridps status`` included), which must not import torch for them.

Owns the figures only; ``search`` and ``peers`` use them, and the precisions a plan takes
are ``Config``'s (a test holds the two equal).
"""

#: the upper end of the largest-model search, in layers
DEFAULT_MAX_LAYERS = 1024
#: the same with a disk tier, which holds models many times the size of memory
DEFAULT_MAX_LAYERS_WITH_DISK = 16384
#: simulated iterations: the warm-up and two replays of its trace. The first replay still
#: brings back what the warm-up's placement left where a steady iteration does not find it
#: (the warm-up's step writes the params back to the host and moves optimizer rows to the GPU;
#: with a disk tier, what it left on the disk), so the steady iteration whose bytes the plan
#: reports is the third: a 24-layer GPT of hidden 2048 on a 14 GB GPU read 2.66 GB up a step in
#: the second, 1.48 GB in the third; a 2-layer GPT on GPUs of 0.35-0.7 of its model data read
#: 0.18-1.1 MB more up in the second than a run's steady step, the third exactly as much
DEFAULT_ITERATIONS = 3
#: the seconds of simulation the search for the largest model may spend with a disk tier
#: before it answers by the linear rule instead (None: no limit, the default without a disk)
DEFAULT_SEARCH_SECONDS_WITH_DISK = 120.0
#: the disk tier's sustained bandwidth, GB/s (1e9 B/s), read and write: a PCIe 4.0 x4 NVMe
#: drive under mixed load (see docs/PLANNING.md, "The disk tier in plans")
DEFAULT_NVME_READ_GBPS = 3.0
DEFAULT_NVME_WRITE_GBPS = 2.0
#: the simulations the search may run
DEFAULT_MAX_PROBES = 12
#: DeepSpeed's default ``additional_buffer_factor`` of its memory estimators
DEEPSPEED_BUFFER_FACTOR = 1.5
#: the precisions a plan takes: the keys of ``hybridps.common.config.PRECISIONS``
PRECISION_NAMES = ("fp32", "fp16", "bf16")
