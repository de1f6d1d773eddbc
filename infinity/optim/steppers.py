"""Steppers: the pipelines that run one Adam step over the shards the shard store lends.

`TorchFusedStepper` (`optim.torch_stepper`): state in device-tier memory, stepped by torch's fused AdamW.
`NativeStepper`: state in host memory or on NVMe, stepped shard by shard by the native CPU Adam,
which also writes the new compute-dtype weights (the fused copy-out). From NVMe it streams: the next
shards' state is read while one is stepped (read ahead) and written back without waiting (write
behind). With `arrive` it steps a shard as its final gradient arrives, while backward goes on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from infinity.optim.cpu_adam import adam_step_flat
from infinity.optim.param_steps import Presence, Run, count_step, partial_runs, step_presence
from infinity.partition.flat_param import FlatParam
from infinity.profiler.format import OPTIMIZER_STEP_WAIT
from infinity.profiler.null_writer import NullTraceWriter
from infinity.shards import LentShard, Returned, ShardRecord, ShardStore
from infinity.shards.moments import moment_format
from infinity.storage import StorageError

Hyper = Callable[[int], dict[str, Any]]  # a param group's lr, betas, eps and weight_decay, by index


class Stepper(Protocol):
    stepped_in_backward: int

    @property
    def in_progress(self) -> bool:
        """Some shards of a step not yet called are stepped (or being) already: stepped as their gradients
        arrived in backward. A deferred step, being settled as its shards are needed, is not: `step()` was
        called, and whoever reads a shard settles it first."""

    def arrive(self, flat: FlatParam, grad: torch.Tensor) -> None:
        """`flat`'s whole gradient for this step (host fp32): step it now or soon."""

    def step(self, flats: list[FlatParam], grad_scale: float) -> None:
        """Step every shard of `flats` not stepped on arrival, gradients multiplied by `grad_scale`."""

    def defer(self, flats: list[FlatParam], grad_scale: float, hyper: list[dict[str, Any]]) -> None:
        """Step `flats` later, each when its bytes are next needed, with these gradient scale and
        hyper-parameters (per param group); `flats` in the order they will be needed."""

    def expect_defer(self) -> None:
        """The backward of a step that will be deferred has begun: prepare what that step reads first."""

    def drain(self, raise_errors: bool = True) -> None:
        """Finish every write in flight; without `raise_errors` (closing) a storage error of one is dropped
        and the rest are still waited for."""


class NativeStepper:
    """The native CPU Adam over lent shards, streamed through host memory in a window.

    Memory bound (host): `host_bytes(window, shard_elems)`. At most `window` shards' state is held at
    once, read ahead or being written back (reads for shards beyond it wait until earlier writes are
    done), whatever the store's budget; one more shard's worth covers the store's staging.
    """

    def __init__(
        self,
        shards: ShardStore,
        hyper: Hyper,
        adamw_mode: bool,
        window: int,
        prof=None,
        read_ahead: bool = True,
        write_behind: bool = True,
    ) -> None:
        """`prof` records the waits on the store and, in the optimizer phase, each shard's arithmetic;
        `read_ahead` / `write_behind` (`offload_optimizer.pipeline_read` / `pipeline_write`): read the next
        shards' state while one is stepped / write a stepped shard back while the next is stepped; without
        them each shard's state is read when it is stepped / written before the next is."""
        self.shards = shards
        self.hyper = hyper
        self.adamw_mode = adamw_mode
        self.window = max(1, window)
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        self.prof = prof if prof is not None else NullTraceWriter()
        self.stepped_in_backward = 0  # shards stepped while backward was still running (a counter)
        self.stepped_when_needed = 0  # shards whose deferred step ran when they were next needed (a counter)
        self._arrived: deque[tuple[FlatParam, torch.Tensor, Presence]] = deque()  # final gradients, state read ahead
        self._returning: deque[Returned] = deque()  # stepped shards whose writes are in flight
        self._behind: deque[Returned] = deque()  # a finished deferred step's last writes, still in flight
        self._stepped: set[FlatParam] = set()  # stepped this step
        self._deferred: deque[FlatParam] = deque()  # owed a step, in the order they will be needed
        self._deferred_args: tuple[float, list[dict[str, Any]]] = (1.0, [])
        self._deferred_used: dict[FlatParam, Presence] = {}  # the deferred step's parameters with a gradient
        self._last_deferred: list[FlatParam] = []  # the last deferred step's order: the next one's, most likely
        self._read_reserve = 0  # shards of the window kept for reads while stepped ones are written back

    @staticmethod
    def shard_state_bytes(shard_elems: int, moments: str = "fp32") -> int:
        """One shard's fp32 master and gradient and its moments (in format `moments`) in host memory."""
        return 8 * shard_elems + moment_format(moments).state_bytes(shard_elems)

    @staticmethod
    def host_bytes(window: int, shard_elems: int, moments: str = "fp32") -> int:
        """The host memory this pipeline holds at most: `window` + 1 shards' state."""
        return (max(1, window) + 1) * NativeStepper.shard_state_bytes(shard_elems, moments)

    @property
    def in_progress(self) -> bool:
        return bool(self._arrived) or (not self._deferred and bool(self._returning or self._stepped))

    def arrive(self, flat: FlatParam, grad: torch.Tensor) -> None:
        """Read the shard's state ahead now; step the shards that arrived a few blocks ago."""
        self.shards.prefetch_state([flat], with_grad=False)
        self._arrived.append((flat, grad, step_presence(self.shards, flat)))
        # Half the window waits for its reads (they had a block of backward to arrive); the other half
        # of the window's host memory holds the stepped shards whose writes are still in flight.
        while len(self._arrived) > max(1, self.window // 2):
            flat, grad, used = self._arrived.popleft()
            self._step_one(flat, grad, 1.0, used=used)
            self.stepped_in_backward += 1

    def step(self, flats: list[FlatParam], grad_scale: float) -> None:
        self.shards.finish_grad_writes()
        while self._arrived:  # stepped as their gradients arrived, but for the last few
            flat, grad, used = self._arrived.popleft()
            self._step_one(flat, grad, grad_scale, used=used)
        todo = [f for f in flats if f not in self._stepped]
        self._reserve_reads(len(todo))
        for i, flat in enumerate(todo):
            # read ahead: the next shards' state comes in while this one is stepped, in what the window
            # leaves beside the shards still being written back
            self.shards.prefetch_state(todo[i : i + self._read_room()], with_grad=True)
            self._step_one(flat, None, grad_scale, used=step_presence(self.shards, flat))
        self.drain()
        self._stepped.clear()
        self._read_reserve = 0

    def defer(self, flats: list[FlatParam], grad_scale: float, hyper: list[dict[str, Any]]) -> None:
        """Owe each shard its step: the store settles it when the shard is next needed (the next forward's
        gather, or anyone reading it), stepping the queue in order up to it with the state of the next
        shards read ahead meanwhile, so the I/O overlaps that forward."""
        self.settle_all()  # a step owed since the last one (nothing needed those shards) comes first
        self._finish_behind()
        self.shards.finish_grad_writes()
        self._deferred = deque(flats)
        self._last_deferred = list(flats)
        self._reserve_reads(len(flats))
        self._deferred_args = (grad_scale, hyper)
        self._deferred_used = {flat: step_presence(self.shards, flat) for flat in flats}
        for flat in flats:
            self.shards.owe(flat, self._settle_through)
        self._read_ahead_deferred()

    def expect_defer(self) -> None:
        """Read the state of the shards the deferred step takes first (in the last deferred step's order) into
        the window, idle during this backward: those reads overlap backward, not the next forward. Not their
        gradients (still arriving), nor a master that is the parameter shard (backward's gather reads it, and
        the step finds that copy)."""
        self._finish_behind()
        if not self._deferred and not self._returning:  # the window is empty (the owed steps all settled)
            master = not self.shards.placement.master_is_param
            self.shards.prefetch_state(self._last_deferred[: self.window], with_grad=False, master=master)

    def _settle_through(self, flat: FlatParam) -> None:
        grad_scale, hyper = self._deferred_args
        while self._deferred:
            head = self._deferred.popleft()
            self.shards.discharge(head)
            self._step_one(head, None, grad_scale, hyper, gather_next=True, used=self._deferred_used.pop(head, None))
            self.stepped_when_needed += 1
            if self._deferred:  # the room the step's finished writes left: the next shards' reads
                self._read_ahead_deferred()
            if head is flat:
                break
        if not self._deferred:  # the step is done: its last writes go on behind the forward (may queue behind reads)
            self._behind.extend(self._returning)
            self._returning.clear()
            self._stepped.clear()
            self._read_reserve = 0

    def _reserve_reads(self, shards: int) -> None:
        """A step of `shards` shards streams through a smaller window: keep half of the window for the next
        shards' reads, so that the writes of those just stepped never take it all and leave the rest to be
        read one at a time after them (the disk then serves writes and reads by turns, not together: a 3e9
        GPT's clipped forward moved 2.67 GB/s of both, 3.25 with the reserve). A window that holds the whole
        step (read during backward) keeps none. At least one write still goes on behind the next shard's step."""
        self._read_reserve = max(0, min(self.window // 2, self.window - 2)) if shards > self.window else 0

    def _read_room(self) -> int:
        """Shards whose state may be read now, counting the one to step: what the window leaves beside the
        shards still being written back (one without read-ahead)."""
        return max(1, self.window - len(self._returning)) if self.read_ahead else 1

    def _read_ahead_deferred(self) -> None:
        self.shards.prefetch_state(list(self._deferred)[: self._read_room()], with_grad=True)

    def settle_all(self) -> None:
        if self._deferred:
            self.shards.settle(self._deferred[-1])

    def _step_one(
        self,
        flat: FlatParam,
        grad: torch.Tensor | None,
        grad_scale: float,
        hyper: list[dict[str, Any]] | None = None,
        gather_next: bool = False,
        used: Presence = None,
    ) -> None:
        if grad is None:  # a gradient to be recomputed is, before the wait for the state reads begins
            self.shards.prepare_grad(flat)
        block = self._span_name(flat.name)
        start = time.perf_counter_ns()
        self.prof.open_span("stall")  # a wait for memory inside is part of this one
        try:
            lent = self.shards.lend(flat, with_grad=grad is None, gather_next=gather_next)
        finally:
            self.prof.close_span("stall")
        fetched = time.perf_counter_ns()
        if lent.fetched:  # it waited for reads of its state
            self.prof.stall(block, start, fetched, self._waited_on("nvme->host"))
        try:
            record = self.shards.records[flat]
            runs = partial_runs(flat, record, used)
            count_step(flat, record, used)
            self._stepped.add(flat)
            group = hyper[flat.group_index] if hyper is not None else self.hyper(flat.group_index)
            grad = lent.grad if grad is None else grad
            written = self._adam(lent, grad, record, runs, grad_scale, group)
        except BaseException:
            Returned(self.shards, lent, []).finish()
            raise
        self.prof.compute(block, fetched, time.perf_counter_ns())
        self._returning.append(self.shards.give_back(lent, param_written=written, gather_next=gather_next))
        # the shards read ahead (on arrival, or kept room for: `_reserve_reads`) share the window's host
        # memory with those being written
        in_flight = max(1, self.window - max(len(self._arrived), self._read_reserve)) if self.write_behind else 1
        while len(self._returning) >= in_flight:
            self._finish_oldest()

    def _span_name(self, flat_name: str) -> str:
        """What the step's spans are recorded for: the block in the optimizer phase; in forward and backward
        the flat parameter ("<block>#<group>"), so that its step is not taken for the block's own compute."""
        return flat_name.split("#", 1)[0] if self.prof.phase == "optimizer" else flat_name

    def _waited_on(self, pair: str) -> str:
        """A wait's label: the tier pair in the optimizer phase; in forward and backward, a wait of the
        optimizer step running there (not of the block's gather)."""
        return pair if self.prof.phase == "optimizer" else OPTIMIZER_STEP_WAIT

    def _finish(self, returned: Returned) -> None:
        """Wait for `returned`'s writes, recorded as a stall (spans inside a hook's own are dropped)."""
        start = time.perf_counter_ns()
        returned.finish()
        if returned.writes:
            end = time.perf_counter_ns()
            self.prof.stall(self._span_name(returned.flat.name), start, end, self._waited_on("host->nvme"))

    def _finish_oldest(self) -> None:
        self._finish(self._returning.popleft())

    def _adam(
        self,
        lent: LentShard,
        grad: torch.Tensor,
        record: ShardRecord,
        runs: list[Run] | None,
        grad_scale: float,
        group: dict[str, Any],
    ) -> bool:
        """One native pass over the shard, or one per run (`param_steps.partial_runs`: the elements between runs
        keep their weights, copied into `param_out`); returns whether it also wrote the new compute-dtype weights
        into `param_out` (the fused copy-out)."""
        out = lent.param_out
        fused = out is not None and out.dtype in (torch.bfloat16, torch.float16) and out.device.type == "cpu"
        if runs is None:
            self._adam_pass(lent.master, grad, lent.exp_avg, lent.exp_avg_sq, out if fused else None, record.step,
                            grad_scale, group, lent.moments)  # fmt: skip
            return fused
        m, g, v1, v2 = lent.master, grad, lent.exp_avg, lent.exp_avg_sq
        done = 0
        for r in runs:
            if fused and done < r.lo:
                out[done : r.lo].copy_(m[done : r.lo])
            self._adam_pass(m[r.lo : r.hi], g[r.lo : r.hi], v1[r.lo : r.hi], v2[r.lo : r.hi],
                            out[r.lo : r.hi] if fused else None, r.step, grad_scale, group, {})  # fmt: skip
            done = r.hi
        if fused:
            out[done:].copy_(m[done:])
        return fused

    def _adam_pass(self, master, grad, exp_avg, exp_avg_sq, out, step, grad_scale, group, moments) -> None:
        adam_step_flat(
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=self.adamw_mode,
            out_copy=out,
            grad_scale=grad_scale,
            moments=self.shards.placement.moments,
            exp_avg_scale=moments.get("exp_avg_scale"),
            exp_avg_sq_scale=moments.get("exp_avg_sq_scale"),
        )

    def _finish_behind(self) -> None:
        """Wait for a finished deferred step's writes still in flight (done by now, most likely)."""
        while self._behind:
            self._finish(self._behind.popleft())

    def drain(self, raise_errors: bool = True) -> None:
        while self._behind or self._returning:
            try:
                if self._behind:
                    self._finish(self._behind.popleft())
                else:
                    self._finish_oldest()
            except StorageError:
                if raise_errors:
                    raise
