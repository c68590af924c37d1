"""torch_mpmd: MPMD pipeline parallelism for PyTorch with a C++ core.

Importing the package does not import torch; ``torch_mpmd.schedules`` needs
only the compiled ``torch_mpmd._C`` extension.
"""

from torch_mpmd import schedules

__version__ = "0.1.0"

__all__ = ["__version__", "schedules"]
