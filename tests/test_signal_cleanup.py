"""Swap files go when a signal ends the process, and the process still ends as that signal would.

Each test runs a real interpreter that opens a store on a real disk, sends it a real signal, and looks
at the directory and the exit status afterwards.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from child_signals import default_signal_actions

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk, mounts that refuse it

_PRELUDE = """
import os, signal, sys, time
import torch
from infinity.config import AioConfig
from infinity.storage import TierBudgets, TierStore
def open_store(rank=0):
    store = TierStore(sys.argv[1], AioConfig(), TierBudgets(), rank=rank, nvme_grow_bytes=1 << 20)
    store.put("w", torch.arange(1000.0), "nvme").wait()
    return store
"""


def _start(code: str, directory: Path) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-c", _PRELUDE + code, str(directory)]
    child = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signal_actions
    )
    ready = child.stdout.readline().strip()
    assert ready, child.communicate(timeout=30)[1]
    return child, ready


def _finish(child: subprocess.Popen) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=60)
    return child.returncode, out, err


_WAIT = """
store = open_store()
print(store.swap_path, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_default_action_signal_removes_the_swap_file_and_ends_the_process_with_it(disk_dir: Path, sig) -> None:
    child, swap = _start(_WAIT, disk_dir)
    assert Path(swap).exists()
    child.send_signal(sig)
    code, _, err = _finish(child)
    assert code == -sig, err  # killed by that signal, as without infinity
    assert list(disk_dir.iterdir()) == []


_WAIT_IN_NATIVE_CODE = """
import ctypes
store = open_store()
print(store.swap_path, flush=True)
libc = ctypes.CDLL(None)
mutex, cond = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)  # zeros: the static initializers
libc.pthread_mutex_lock(mutex)
libc.pthread_cond_wait(cond, mutex)  # forever, and signals do not interrupt it: no Python handler could run
"""


def test_the_swap_file_goes_even_while_the_main_thread_is_blocked_in_native_code(disk_dir: Path) -> None:
    child, _ = _start(_WAIT_IN_NATIVE_CODE, disk_dir)
    child.send_signal(signal.SIGTERM)
    try:
        code, _, err = _finish(child)
    finally:
        child.kill()
    assert code == -signal.SIGTERM, err
    assert list(disk_dir.iterdir()) == []


_SIGINT_DEFAULT_ACTION = """
signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt: SIGINT kills, as for a non-Python host
store = open_store()
print(store.swap_path, flush=True)
time.sleep(60)
"""


def test_sigint_at_its_default_action_removes_the_swap_file_and_ends_the_process(disk_dir: Path) -> None:
    child, _ = _start(_SIGINT_DEFAULT_ACTION, disk_dir)
    child.send_signal(signal.SIGINT)
    code, _, err = _finish(child)
    assert code == -signal.SIGINT, err
    assert list(disk_dir.iterdir()) == []


def test_an_uncaught_keyboard_interrupt_removes_the_swap_file_and_exits_as_sigint(disk_dir: Path) -> None:
    child, _ = _start(_WAIT, disk_dir)
    child.send_signal(signal.SIGINT)
    code, _, err = _finish(child)
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err
    assert list(disk_dir.iterdir()) == []


_CAUGHT_INTERRUPT = """
store = open_store()
try:  # the ready line inside: the parent's SIGINT may come as soon as it is read
    print(store.swap_path, flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
# An interactive user interrupts a loop, then goes on (or saves a checkpoint): the store still works.
got = store.fetch("w", "host").wait()
print("intact" if torch.equal(got, torch.arange(1000.0)) else "WRONG", os.path.exists(store.swap_path), flush=True)
"""


def test_a_caught_keyboard_interrupt_leaves_a_working_store(disk_dir: Path) -> None:
    child, _ = _start(_CAUGHT_INTERRUPT, disk_dir)
    child.send_signal(signal.SIGINT)
    code, out, err = _finish(child)
    assert code == 0, err
    assert out.split() == ["interrupted", "intact", "True"]
    assert list(disk_dir.iterdir()) == []  # removed at the normal exit


_OWN_HANDLER = """
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # e.g. save a checkpoint, then exit
store = open_store()
print(store.swap_path, flush=True)
while not stop:
    time.sleep(0.01)
got = store.fetch("w", "host").wait()
print("intact" if torch.equal(got, torch.arange(1000.0)) else "WRONG", flush=True)
sys.exit(3)
"""


def test_a_programs_own_sigterm_handler_runs_with_the_store_intact(disk_dir: Path) -> None:
    child, _ = _start(_OWN_HANDLER, disk_dir)
    child.send_signal(signal.SIGTERM)
    code, out, err = _finish(child)
    assert code == 3 and out.strip() == "intact", err
    assert list(disk_dir.iterdir()) == []  # removed when that program exited


_FORKED_CHILD = """
store = open_store()
pid = os.fork()
if pid == 0:  # the child inherits the handler, not the file
    time.sleep(60)
    os._exit(0)
print(store.swap_path, pid, flush=True)
sys.stdin.readline()
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print(os.WTERMSIG(status), os.path.exists(store.swap_path), flush=True)
"""


def test_a_forked_child_killed_by_a_signal_leaves_its_parents_file(disk_dir: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + _FORKED_CHILD, str(disk_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signal_actions,
    )
    child.stdout.readline()
    out, err = child.communicate("go\n", timeout=60)
    assert child.returncode == 0, err
    assert out.split() == [str(int(signal.SIGTERM)), "True"]
    assert list(disk_dir.iterdir()) == []


_TWO_STORES = """
a, b = open_store(0), open_store(1)
a.close()  # closed stores leave the registry
c = open_store(2)
print(b.swap_path, c.swap_path, flush=True)
time.sleep(60)
"""


def test_every_live_store_of_the_process_is_cleaned_up(disk_dir: Path) -> None:
    child, _ = _start(_TWO_STORES, disk_dir)
    child.send_signal(signal.SIGTERM)
    code, _, err = _finish(child)
    assert code == -signal.SIGTERM, err
    assert list(disk_dir.iterdir()) == []
