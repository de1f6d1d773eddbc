"""Chooses the native kernels' SIMD path from the CPU's features, or from INFINITY_SIMD."""

import functools
import os
from pathlib import Path

SIMD_ENV_VAR = "INFINITY_SIMD"
SIMD_PATHS = ("avx512", "avx2", "scalar")  # best first

# CPU flags (as py-cpuinfo spells them) each path's instructions need.
_REQUIRED_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: the kernel's list in /proc/cpuinfo on Linux, else py-cpuinfo's (queried once).

    py-cpuinfo takes about a second: asked on the first optimizer step, that second was a stall inside the
    first step (the profiler showed it as a disk read)."""
    flags = _proc_cpuinfo_flags()
    if flags is not None:
        return flags
    import cpuinfo

    return frozenset(cpuinfo.get_cpu_info().get("flags", ()))


def _proc_cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The first processor's "flags" line of `path` (x86 Linux), as py-cpuinfo spells them; None without one."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return frozenset(value.split())
    return None


def supported_paths() -> tuple[str, ...]:
    """The paths this CPU can run, best first; always ends with 'scalar'."""
    flags = cpu_flags()
    return tuple(path for path in SIMD_PATHS if _REQUIRED_FLAGS[path] <= flags)


def resolve_simd(simd: str | None = None) -> str:
    """The path to run: `simd` if given, else $INFINITY_SIMD if set, else the best supported.

    Raises ValueError for an unknown name or a path this CPU does not support.
    """
    source = "simd"
    if simd is None:
        simd = os.environ.get(SIMD_ENV_VAR) or None
        source = SIMD_ENV_VAR
    if simd is None:
        return supported_paths()[0]
    if simd not in SIMD_PATHS:
        raise ValueError(f"{source}={simd!r} is not a SIMD path; choose one of {', '.join(SIMD_PATHS)}")
    if simd not in supported_paths():
        missing = sorted(_REQUIRED_FLAGS[simd] - cpu_flags())
        raise ValueError(
            f"{source}={simd!r} is not supported by this CPU (missing flags: {', '.join(missing)}); "
            f"supported: {', '.join(supported_paths())}"
        )
    return simd
