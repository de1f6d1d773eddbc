"""Tiers, budgets and moves of flat shards between device memory, pinned host buffers and NVMe files.

Primitives: `BufferPool` (aligned host buffers), `open_engine` (async direct I/O), `NvmeFile` (one
preallocated swap file per rank, every read checked against the CRC32C of its write). Policy:
`TierStore` (fetch, release, write, prefetch, evict, drop). `check_free_space` checks a swap path
up front against what its runs will write there (`swap_file_bytes` per rank).
"""

from infinity.storage.aio import AiofilesEngine, DirectEngine, IoHandle, open_engine, supports_direct_io
from infinity.storage.buffer_pool import ALIGN, BufferPool, aligned_empty, aligned_view, copy_bytes
from infinity.storage.checksum import crc32c, resolve_crc32c_path
from infinity.storage.device_memory import DeviceMemory
from infinity.storage.disk_space import check_free_space
from infinity.storage.errors import BudgetError, ChecksumError, StorageError, SwapFileChangedError, SwapFileError
from infinity.storage.nvme_file import NvmeFile, swap_file_bytes
from infinity.storage.recorder import ListRecorder, MoveCounter, MoveEvent, Recorder
from infinity.storage.tier_store import TierBudgets, TierStore
from infinity.storage.tier_types import FetchHandle, MoveHandle, Tier

__all__ = [
    "ALIGN",
    "AiofilesEngine",
    "BudgetError",
    "BufferPool",
    "ChecksumError",
    "DeviceMemory",
    "DirectEngine",
    "FetchHandle",
    "IoHandle",
    "ListRecorder",
    "MoveCounter",
    "MoveEvent",
    "MoveHandle",
    "NvmeFile",
    "Recorder",
    "StorageError",
    "SwapFileChangedError",
    "SwapFileError",
    "Tier",
    "TierBudgets",
    "TierStore",
    "aligned_empty",
    "aligned_view",
    "check_free_space",
    "copy_bytes",
    "crc32c",
    "open_engine",
    "resolve_crc32c_path",
    "supports_direct_io",
    "swap_file_bytes",
]
