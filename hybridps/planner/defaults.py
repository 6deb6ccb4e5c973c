"""The planner's defaults, without torch: the command line's parser reads them in every
``hybridps`` command (``hybridps status`` included), which must not import torch for them.

Owns the figures only; ``search`` and ``peers`` use them, and the precisions a plan takes
are ``Config``'s (a test holds the two equal).
"""

#: the upper end of the largest-model search, in layers
DEFAULT_MAX_LAYERS = 1024
#: the simulations the search may run
DEFAULT_MAX_PROBES = 12
#: DeepSpeed's default ``additional_buffer_factor`` of its memory estimators
DEEPSPEED_BUFFER_FACTOR = 1.5
#: the precisions a plan takes: the keys of ``hybridps.common.config.PRECISIONS``
PRECISION_NAMES = ("fp32", "fp16", "bf16")
