"""adaptmem: adaptive, per-block activation memory management for PyTorch training.

The public face only; see README.md for use.
"""

from adaptmem.controller import MemoryManager, manage
from adaptmem.modes import ALLOWED_MODES, LOSSLESS_MODES, Mode
from adaptmem.policy import Policy, PolicyError, load_policy
from adaptmem.retry import InexactRetryError, StepOutOfMemoryError
from adaptmem.strategies.compress import CompressOptions
from adaptmem.strategies.offload import OffloadOptions
from adaptmem.wrap import BlockHandle, get_handles, instrument, restore

__version__ = "0.1.0"

__all__ = [
    "ALLOWED_MODES",
    "LOSSLESS_MODES",
    "BlockHandle",
    "CompressOptions",
    "InexactRetryError",
    "MemoryManager",
    "Mode",
    "OffloadOptions",
    "Policy",
    "PolicyError",
    "StepOutOfMemoryError",
    "get_handles",
    "instrument",
    "load_policy",
    "manage",
    "restore",
]
