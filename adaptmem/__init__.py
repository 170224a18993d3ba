"""adaptmem: adaptive, per-block activation memory management for PyTorch training.

The public face only; see README.md for use.
"""

from adaptmem.modes import ALLOWED_MODES, LOSSLESS_MODES, Mode
from adaptmem.strategies.compress import CompressOptions
from adaptmem.strategies.offload import OffloadOptions
from adaptmem.wrap import BlockHandle, get_handles, instrument, restore

__version__ = "0.1.0"

__all__ = [
    "ALLOWED_MODES",
    "LOSSLESS_MODES",
    "BlockHandle",
    "CompressOptions",
    "Mode",
    "OffloadOptions",
    "get_handles",
    "instrument",
    "restore",
]
