"""Torch's warning about a missing NumPy, kept off the screen of HybridPS's commands.

Owns ``quiet_missing_numpy()``, which the command-line entry points (``hybridps``,
``hybridps-manager``, ``python -m hybridps.planner`` and ``python -m hybridps.train``, the
module each torchrun rank runs) call before anything imports torch. Imports nothing but the
standard library, so that it can run first.

Does not own any use of NumPy: HybridPS makes none, and NumPy is not one of its dependencies.
Code that imports ``hybridps`` as a library keeps its own warning filters.

[Note: torch's NumPy warning at import]
torch 2.13's ``import torch`` imports ``torch.export``, which imports
``torch._subclasses.functional_tensor``; the body of its ``FunctionalTensor`` class wraps
``Tensor.cpu`` and friends, and in doing so torch's C++ side asks, once per process, whether
NumPy can be imported (``is_numpy_available`` in torch/csrc/utils/tensor_numpy.cpp). Without
NumPy installed that raises the UserWarning "Failed to initialize NumPy: No module named
'numpy'": on every ``import torch``, before any line of HybridPS runs, whatever it then
does. Nothing in HybridPS calls NumPy interop (``Tensor.numpy()``, ``torch.from_numpy``), so
the warning tells a user of the commands nothing they need, and installing NumPy only to
silence it would add a dependency nothing uses. The filter matches exactly that message.
"""

from __future__ import annotations

import warnings

#: the start of torch's message (the rest names the import error and torch's source line)
NUMPY_WARNING = "Failed to initialize NumPy"


def quiet_missing_numpy() -> None:
    """Ignore torch's "Failed to initialize NumPy" UserWarning in this process ([Note: torch's
    NumPy warning at import]); call it before torch is imported."""
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
