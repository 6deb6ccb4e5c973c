"""The planner's defaults, without torch: the command line's parser reads them in every
``hybridps`` command (``hybridps status`` included), which must not import torch for them.

Owns the figures only; ``search`` and ``peers`` use them, and the precisions a plan takes
are ``Config``'s (a test holds the two equal).
"""

#: the upper end of the largest-model search, in layers
DEFAULT_MAX_LAYERS = 1024
#: the same with a disk tier, which holds models many times the size of memory
DEFAULT_MAX_LAYERS_WITH_DISK = 16384
#: simulated iterations: the warm-up and one replay of its trace
DEFAULT_ITERATIONS = 2
#: the same for one rank with a disk tier: the first replay still reads back what the warm-up
#: left on the disk, so the steady iteration whose disk traffic is reported is the third
DEFAULT_ITERATIONS_WITH_DISK = 3
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
