"""Loads the compiled module `infinity._native`, or says how to build it."""

from types import ModuleType

_BUILD_HINT = (
    "infinity's native module (infinity._native) is not built. Build it with "
    "`pip install -e .` from the repository root (needs a C++17 compiler with OpenMP), "
    "or run `make test`, which sets up everything."
)


def load_native() -> ModuleType:
    """Return the native module; raise ImportError with build instructions if it is missing."""
    try:
        from infinity import _native
    except ImportError as exc:
        raise ImportError(f"{_BUILD_HINT} (import error: {exc})") from exc
    return _native
