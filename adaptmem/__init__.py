"""adaptmem: adaptive, per-block activation memory management for PyTorch training.

The public face only; see README.md for use.
"""

from adaptmem.config.policy import Policy, PolicyError, load_policy
from adaptmem.control.events import read_log
from adaptmem.control.manage import manage
from adaptmem.control.manager import MemoryManager
from adaptmem.control.retry import InexactRetryError, StepOutOfMemoryError
from adaptmem.devices.engine import release_failed_backward
from adaptmem.modes import ALLOWED_MODES, LOSSLESS_MODES, HeadMode, Mode
from adaptmem.strategies import CompressOptions, OffloadOptions
from adaptmem.strategies.head import LogitsNotMaterializedError
from adaptmem.wrapping import BlockHandle, HeadHandle, compile_blocks, get_handles, get_head, instrument, restore

__version__ = "0.1.0"

__all__ = [
    "ALLOWED_MODES",
    "LOSSLESS_MODES",
    "BlockHandle",
    "CompressOptions",
    "HeadHandle",
    "HeadMode",
    "InexactRetryError",
    "LogitsNotMaterializedError",
    "MemoryManager",
    "Mode",
    "OffloadOptions",
    "Policy",
    "PolicyError",
    "StepOutOfMemoryError",
    "compile_blocks",
    "get_handles",
    "instrument",
    "get_head",
    "load_policy",
    "manage",
    "read_log",
    "release_failed_backward",
    "restore",
]
