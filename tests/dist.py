"""Run a function in N real processes joined by a Gloo process group, the way torchrun would.

    results = run_distributed(fn, 2, x, timeout_s=60, scale=3)   # fn(x, scale=3) on ranks 0 and 1

`fn` must be a module-level function (it is pickled by reference) and its return value picklable.
Each rank gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE in its environment,
so code that calls `torch.distributed.init_process_group()` itself finds them. The rendezvous store is
hosted by this (parent) process on a port the OS picked, as torchrun's agent does, so there is no
free-port race between tests. Processes fork from a server that has imported torch once, so starting
a rank takes milliseconds rather than the seconds of a fresh interpreter. Each rank runs with
`torch.set_num_threads(num_threads)` (1 by default: 2 cores are shared) and flush-denormal on; its torch
RNG is not seeded for you, so seed inside `fn`.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank raised (or died); `rank` names it, `exception` is the original if it could be pickled."""

    def __init__(self, rank: int, message: str, exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exception = exception


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    # Preloaded once in the server, inherited by every rank; torch._dynamo is what the first optimizer step imports.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])  # only before the server starts
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    init_pg: bool,
    backend: str,
    num_threads: int,
    conn,
    fn,
    args,
    kwargs,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",  # connect to the parent's store rather than host one on rank 0
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before a timeout kill
    torch.set_num_threads(num_threads)
    torch.set_flush_denormal(True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, bound before the group (as the engine does)
        if init_pg:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        payload = ("ok", pickle.dumps(fn(*args, **kwargs)))
    except BaseException as e:  # noqa: B036 - everything a rank raises must reach the parent
        tb = traceback.format_exc()
        try:
            exc = pickle.dumps(e)
            pickle.loads(exc)
        except Exception:
            exc = None
        payload = ("error", (f"{type(e).__name__}: {e}", tb, exc))
    conn.send(payload)
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    init_process_group: bool = True,
    num_threads: int = 1,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks and return their results in rank order.

    With `init_process_group` the harness joins a Gloo group (or with `backend="nccl"` an NCCL one, rank r
    bound to GPU r first) before calling `fn`; otherwise `fn` does it from the environment. If a rank
    raises, all ranks are killed and `RankError` (chained to the original) names the rank and carries its
    traceback. Past `timeout_s` the ranks still running dump their stacks
    to stderr, are killed, and `TimeoutError` names them.
    """
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    procs, conns = [], []
    ok = False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(
                    rank,
                    world_size,
                    store.port,
                    timeout_s,
                    init_process_group,
                    backend,
                    num_threads,
                    send,
                    fn,
                    args,
                    kwargs,
                ),
                name=f"rank{rank}",
                daemon=True,
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        results = _collect(fn, procs, conns, timeout_s)
        ok = True
        return results
    finally:
        for p in procs:
            p.join(5 if ok else 0)  # let finished ranks tear down; on failure the others may be stuck in a collective
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()
        del store


def _collect(fn: Callable, procs: list, conns: list, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(procs):
        waiting = {conns[r]: r for r in range(len(procs)) if r not in results}
        waiting.update({procs[r].sentinel: r for r in range(len(procs)) if r not in results})
        ready = mp.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            _dump_stacks([procs[r] for r in range(len(procs)) if r not in results])
            running = sorted(set(range(len(procs))) - set(results))
            raise TimeoutError(
                f"run_distributed({fn.__qualname__}, world_size={len(procs)}) timed out after {timeout_s}s; "
                f"ranks {running} were still running (stacks above, in stderr) and were killed"
            )
        for obj in ready:
            rank = waiting[obj]
            if rank in results:
                continue
            try:
                status, data = conns[rank].recv() if conns[rank].poll() else (None, None)
            except EOFError:
                status = None
            if status is None:  # the process ended without sending a result
                procs[rank].join(1)
                status = "died"
                data = (f"exited with code {procs[rank].exitcode} without returning", "", None)
            if status == "ok":
                results[rank] = pickle.loads(data)
                continue
            summary, tb, exc = data
            original = pickle.loads(exc) if exc is not None else None
            raise RankError(
                rank, f"rank {rank} {summary if status == 'died' else 'raised ' + summary}\n{tb}", original
            ) from original
    return [results[r] for r in range(len(procs))]


def _dump_stacks(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(0.5)
    sys.stderr.flush()
