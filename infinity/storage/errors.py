"""The storage layer's exceptions: each names the file, offset, length or budget it is about."""

from __future__ import annotations


class StorageError(OSError):
    """An I/O or swap-path failure; `errno` and `filename` are set, the message says where and why."""


class SwapFileError(StorageError):
    """The swap file is not what the store wrote: truncated, foreign, left by a live run, or damaged."""


class BudgetError(MemoryError):
    """A tier's byte budget cannot hold a request: never (larger than the budget) or not in time."""


class SwapFileChangedError(SwapFileError):
    """The swap file was deleted, replaced, truncated or overwritten while the store used it."""


class ChecksumError(SwapFileError):
    """Bytes read back from the swap file differ from what was written (a CRC32C mismatch)."""
