"""glibc's malloc and transparent huge pages: the environment a training process starts with."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

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
