"""glibc's malloc and transparent huge pages: the environment a training process starts with."""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinity.cli.train import DEFAULT_CONFIG
from infinity.engine.host_memory import (
    huge_pages_environment,
    huge_pages_notice,
    malloc_asks_for_huge_pages,
    transparent_huge_pages,
    without_huge_pages,
)

ASK = "glibc.malloc.hugetlb=1"
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's tunables only")


def test_the_kernel_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert transparent_huge_pages(str(mode)) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert transparent_huge_pages(str(mode)) == "always"
    assert transparent_huge_pages(str(tmp_path / "absent")) is None


@glibc
def test_the_tunable_is_added_beside_the_users_own_and_only_where_it_changes_something() -> None:
    assert huge_pages_environment({"PATH": "/bin"}, "madvise") == {"PATH": "/bin", "GLIBC_TUNABLES": ASK}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    assert huge_pages_environment(mine, "madvise") == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=4:{ASK}"}
    assert huge_pages_environment({"GLIBC_TUNABLES": ASK}, "madvise") is None  # asked already: no re-exec loop
    assert huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise") is None  # the user's
    assert huge_pages_environment({"INFINITY_KEEP_MALLOC": "1"}, "madvise") is None  # the user's opt-out
    assert huge_pages_environment({}, "always") is None  # the kernel gives them unasked
    assert huge_pages_environment({}, "never") is None


def test_asking_is_read_from_the_tunable_and_can_be_taken_back() -> None:
    assert malloc_asks_for_huge_pages({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=4:{ASK}"})
    assert not malloc_asks_for_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not malloc_asks_for_huge_pages({})
    both = {"GLIBC_TUNABLES": f"{ASK}:glibc.malloc.arena_max=4", "X": "1"}
    assert without_huge_pages(both) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4", "X": "1"}
    assert without_huge_pages({"GLIBC_TUNABLES": ASK}) == {}


# The child re-executes itself, then reports its tunables and how much of a freshly touched 256 MiB
# buffer the kernel backs with huge pages (AnonHugePages of the process, before and after).
_CHILD = """
import os, torch
from infinity.engine.host_memory import huge_pages_notice, reexec_with_huge_pages
reexec_with_huge_pages()
def huge_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
before = huge_kib()
buf = torch.empty(64 << 20, dtype=torch.float32)
buf.fill_(1.0)
print(os.environ.get("GLIBC_TUNABLES"), huge_kib() - before, huge_pages_notice() is None, flush=True)
"""


def _child(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@glibc
@pytest.mark.skipif(transparent_huge_pages() != "madvise", reason="the kernel gives huge pages on request only")
def test_a_process_restarted_with_the_tunable_gets_huge_pages_and_one_left_alone_does_not() -> None:
    env = without_huge_pages({**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"})
    tunables, huge_kib, quiet = _child(env)
    assert tunables == ASK and quiet == "True"
    assert int(huge_kib) >= 128 * 1024  # most of the 256 MiB buffer (alignment trims its ends)
    tunables, huge_kib, quiet = _child({**env, "INFINITY_KEEP_MALLOC": "1"})
    assert tunables == "None" and int(huge_kib) == 0 and quiet == "True"  # opted out: no notice either


@glibc
@pytest.mark.skipif(transparent_huge_pages() != "madvise", reason="the kernel gives huge pages on request only")
def test_an_engine_process_started_without_the_tunable_is_told_how_to_ask(monkeypatch) -> None:
    monkeypatch.delenv("INFINITY_KEEP_MALLOC", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in huge_pages_notice()
    monkeypatch.setenv("GLIBC_TUNABLES", ASK)
    assert huge_pages_notice() is None


NOTICE = "page-faulted 4 KiB at a time"


def _budgeted_config(tmp_path: Path) -> Path:
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["zero_optimization"]["host_budget_bytes"] = 1 << 30  # malloc returns freed memory to the OS
    path = tmp_path / "budgeted.json"
    path.write_text(json.dumps(cfg))
    return path


@glibc
@pytest.mark.skipif(transparent_huge_pages() != "madvise", reason="the kernel gives huge pages on request only")
def test_the_command_restarts_with_huge_pages_for_a_budgeted_run_and_an_engine_without_them_says_so(tmp_path):
    env = without_huge_pages({**os.environ, "OMP_NUM_THREADS": "2"})
    env.pop("INFINITY_KEEP_MALLOC", None)
    args = ["train", "--model", "tiny", "--steps", "2", "--config", str(_budgeted_config(tmp_path)),
            "--nvme-path", str(tmp_path / "nvme"), "--save-dir", str(tmp_path / "runs")]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "infinity", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert NOTICE not in done.stderr, done.stderr  # restarted with the tunable: nothing to advise
    # the same run in a process that may not restart itself (an in-process caller): the engine advises
    code = _in_process([*args[:-1], str(tmp_path / "runs2")], env)  # a run of its own: runs/ holds the first's
    assert code.returncode == 0, code.stdout + code.stderr
    assert NOTICE in code.stderr and "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in code.stderr


def _in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    script = f"import sys; from infinity.cli import main; sys.exit(main({args!r}))"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_only_a_run_whose_malloc_returns_memory_to_the_os_is_restarted(tmp_path) -> None:
    from infinity.cli import _parser
    from infinity.cli.train import _returns_memory_to_os, build_config

    plain = _parser().parse_args(["train", "--nvme-path", str(tmp_path)])
    assert not _returns_memory_to_os(build_config(plain, 64))  # the default job sets no host budget
    config = str(_budgeted_config(tmp_path))
    budgeted = _parser().parse_args(["train", "--config", config, "--nvme-path", str(tmp_path)])
    assert _returns_memory_to_os(build_config(budgeted, 64)) == (not torch.cuda.is_available())


_TRIM_CHILD = """
import ctypes
from infinity.engine.host_memory import return_freed_heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
chunks = [libc.malloc(64 << 10) for _ in range(512)]  # 32 MiB below the mmap threshold: malloc's heap
sentinel = libc.malloc(64 << 10)  # keeps the freed run off the heap's top, which malloc trims by itself
for c in chunks:
    ctypes.memset(c, 1, 64 << 10)
for c in chunks:
    libc.free(c)
before = rss()
trimmed = return_freed_heap()
print(trimmed, before - rss())
"""


@glibc
@pytest.mark.parametrize("keep", [False, True])
def test_freed_heap_memory_goes_back_to_the_os_unless_the_user_keeps_malloc_as_it_is(keep: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "INFINITY_KEEP_MALLOC"}
    if keep:
        env["INFINITY_KEEP_MALLOC"] = "1"
    done = subprocess.run([sys.executable, "-c", _TRIM_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trimmed, returned = done.stdout.split()
    assert trimmed == str(not keep)
    if keep:
        assert int(returned) < 4 << 20  # malloc left alone: the freed 32 MiB stay resident
    else:
        assert int(returned) >= 24 << 20  # most of the freed 32 MiB (a chunk's header keeps its page)
