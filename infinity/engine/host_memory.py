"""Process memory hygiene for out-of-core CPU runs: how much freed memory glibc's malloc keeps.

Every I/O and OpenMP thread may get its own malloc arena, each keeping freed block-sized buffers;
two arenas keep the resident set nearer the live bytes. Freed buffers below glibc's (self-raising)
mmap threshold stay in its heap, so buffers of every block size gathered, released and regathered
still grow the resident set: fixing the threshold at 1 MiB returns them to the OS at once (peak RSS
0.89 GB instead of 1.75 GB for a 101M-parameter model with 1.6 GB of state on NVMe) but page-faults
every activation, which cost 30% of a 110M-parameter NVMe step on two cores (6.18 s vs 4.84 s,
plain PyTorch 4.11 s, in one run). So the threshold is fixed only when the run says host memory is
the constraint (`zero_optimization.host_budget_bytes`). INFINITY_KEEP_MALLOC=1 leaves malloc alone.

With the threshold fixed every block-sized buffer is a fresh mapping, and with 4 KiB pages its faults
are most of the cost of first touching it. Where the kernel gives transparent huge pages to those who
ask (`madvise` mode, the common default), glibc asks only if GLIBC_TUNABLES says
`glibc.malloc.hugetlb=1` at process start. With it, first-touch copies run at 14.5 GB/s instead of 3.7
here, and an out-of-core step of a 2.4e9-parameter model on NVMe took 20.3 s instead of 33.0. Outside
that mode it does not pay: two ranks training the 110M GPT in memory took 1.36x DDP's step with it and
1.13x without, in one run. A tunable is read only at start, so the `infinity` command restarts itself
once with it set where its run returns memory to the OS (`reexec_with_huge_pages`), and an engine in
that mode started without it says so.

Returning freed buffers at once has a second cost: the kernel must zero each new mapping, and in a VM
that reports free pages to its host the host must back it again (up to 1 s per 180 MB here, for memory
freed a few seconds before). The same shapes come back every layer, so in that mode the engine also
routes torch's CPU allocations of 1 MiB or more through a native caching allocator that keeps up to
one block's fp32 gradients of freed memory for reuse (`keep_freed_blocks`). Four layers of a 7B-width
Llama on CPU-offloaded shards took 0.82-1.14 s a layer in backward without it and 0.22-0.32 s with
0.8 GiB kept (steps 1-3, one run each); the 35-layer model on NVMe, 99.9-111.7 s a step against
62.7-68.3 s (tools/bench_scale.py, two runs without, four with). Reused memory is not zeroed, as a fresh mapping is:
nothing may read a buffer before writing it (tests poison lent blocks to check).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_applied = False
_FREED_BLOCK_MIN_BYTES = 1 << 20  # the mmap threshold above: smaller blocks stay in malloc's heap
_POISON_LENT_BLOCKS = False  # tests: every block lent is 0xFF bytes (NaN) until written
_freed_block_holders: dict[int, int] = {}  # id -> bytes each holder asked to keep
_missing_told = False


def _malloc_function(name: str) -> Callable[..., int] | None:
    """libc's `name` (mallopt, malloc_trim), or None where malloc is left alone: INFINITY_KEEP_MALLOC=1, or
    no such function (not glibc)."""
    if os.environ.get("INFINITY_KEEP_MALLOC") == "1":
        return None
    libc = ctypes.util.find_library("c")
    if libc is None:
        return None
    try:
        return getattr(ctypes.CDLL(libc), name)
    except (OSError, AttributeError):
        return None


def limit_freed_memory(return_to_os: bool, arenas: int = 2) -> bool:
    """Cap the malloc arenas and, with `return_to_os`, fix the mmap threshold at 1 MiB; once per process.

    Returns False where it does not apply (not glibc, opted out)."""
    global _applied
    mallopt = None if _applied else _malloc_function("mallopt")
    if mallopt is None:
        return _applied
    _applied = bool(mallopt(_M_ARENA_MAX, arenas))
    if return_to_os:
        _applied = bool(mallopt(_M_MMAP_THRESHOLD, 1 << 20)) and _applied
    return _applied


def return_freed_heap() -> bool:
    """Give the OS the whole free pages glibc's heaps keep (`malloc_trim(0)`), once, where something large
    was just freed: a model built in full and then sharded leaves its full weights there. False where it
    does not apply (not glibc, INFINITY_KEEP_MALLOC=1)."""
    trim = _malloc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages(path: str = _THP_MODE) -> str | None:
    """The kernel's transparent huge page mode: "always", "madvise" or "never"; None where unknown."""
    try:
        with open(path) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def _huge_pages_tunable(env: Mapping[str, str]) -> str | None:
    for tunable in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = tunable.partition("=")
        if name == HUGE_PAGES_TUNABLE:
            return value
    return None


def malloc_asks_for_huge_pages(env: Mapping[str, str]) -> bool:
    """Whether a process started with `env` has glibc's malloc ask for transparent huge pages."""
    return _huge_pages_tunable(env) not in (None, "", "0")


def huge_pages_environment(env: Mapping[str, str], thp_mode: str | None = None) -> dict[str, str] | None:
    """`env` with glibc's malloc asking for transparent huge pages, for a process about to start; None
    where that changes nothing or is not ours to change: the tunable set already (by us, or to the user's
    own value), INFINITY_KEEP_MALLOC=1, not glibc, or a kernel whose mode is not `madvise` ("always"
    gives them unasked, "never" never)."""
    thp_mode = transparent_huge_pages() if thp_mode is None else thp_mode
    if env.get("INFINITY_KEEP_MALLOC") == "1" or _huge_pages_tunable(env) is not None or thp_mode != "madvise":
        return None
    if platform.libc_ver()[0] != "glibc":
        return None
    tunables = env.get("GLIBC_TUNABLES")
    ask = f"{HUGE_PAGES_TUNABLE}=1"
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{ask}" if tunables else ask}


def without_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with glibc's malloc not asking for transparent huge pages (for measuring without them)."""
    kept = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t.partition("=")[0] != HUGE_PAGES_TUNABLE]
    out = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
    if kept:
        out["GLIBC_TUNABLES"] = ":".join(kept)
    return out


def reexec_with_huge_pages() -> None:
    """Replace this process by itself started with `huge_pages_environment` (the same pid and arguments:
    a launcher such as torchrun still watches it); returns where nothing would change or exec fails."""
    env = huge_pages_environment(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return


def huge_pages_notice() -> str | None:
    """One line for an engine that returns freed memory to the OS without huge pages it could have asked for."""
    if huge_pages_environment(os.environ) is None:
        return None
    return (
        "infinity: with host_budget_bytes set, freed buffers go back to the OS and every new one is "
        "page-faulted 4 KiB at a time (4x slower first touch here than with huge pages); start Python with "
        "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (the infinity command does), or INFINITY_KEEP_MALLOC=1 to "
        "silence this"
    )


def _load_host_allocator() -> ModuleType | None:
    """The native allocator, or None with a notice (once) where it was not built: an isolated build skips it."""
    global _missing_told
    try:
        from infinity import _host_allocator
    except ImportError as exc:
        if not _missing_told:
            _missing_told = True
            print(
                "infinity: the caching CPU allocator (infinity._host_allocator) is not built, so every freed "
                "buffer of 1 MiB or more is mapped afresh (much slower on some machines); build it with "
                f"`pip install --no-build-isolation -e .` from the repository root ({exc})",
                file=sys.stderr,
            )
        return None
    return _host_allocator


def keep_freed_blocks(cap_bytes: int) -> Callable[[], None]:
    """Route torch's CPU allocations of 1 MiB or more through the native caching allocator, which keeps up
    to `cap_bytes` of freed blocks (the oldest go first) for reuse instead of returning them to the OS;
    returns the function that gives up this hold. With several holders the largest cap applies; with none
    torch gets its own allocator back. Nothing changes with INFINITY_KEEP_MALLOC=1 or a cap of 0."""
    if cap_bytes <= 0 or os.environ.get("INFINITY_KEEP_MALLOC") == "1":
        return lambda: None
    native = _load_host_allocator()
    if native is None:
        return lambda: None
    token = object()
    _freed_block_holders[id(token)] = cap_bytes
    huge = malloc_asks_for_huge_pages(os.environ)  # the blocks glibc would map, mapped as it would
    native.install(max(_freed_block_holders.values()), _FREED_BLOCK_MIN_BYTES, huge, _POISON_LENT_BLOCKS)

    def give_up() -> None:
        if _freed_block_holders.pop(id(token), None) is None:
            return
        if _freed_block_holders:
            native.install(max(_freed_block_holders.values()), _FREED_BLOCK_MIN_BYTES, huge, _POISON_LENT_BLOCKS)
        else:
            native.uninstall()

    return give_up


def freed_block_stats() -> dict[str, int]:
    """The caching allocator's counters: hits, misses, returned (blocks given to the OS), live_bytes,
    cached_bytes, peak_bytes (live + cached at most); all zero where it was never built or used."""
    try:
        from infinity import _host_allocator
    except ImportError:
        return dict.fromkeys(("hits", "misses", "returned", "live_bytes", "cached_bytes", "peak_bytes"), 0)
    return dict(_host_allocator.stats())
