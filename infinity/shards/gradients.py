"""The shard store's gradient accumulators: micro-batch gradients in, the step's sum and norm out.

A mixin of `ShardStore` (its tiers, placement, records, views and crossing). An accumulator lives where
the placement puts `GRAD`: the compute writes into it directly when it is in the compute's memory
(`grad_accumulator`), else gradients come through `accumulate_grad`, crossing from the device in the
compute dtype and promoted to fp32 as they are summed on the host, or written to NVMe.

A gradient sum whose home is NVMe stays in host memory instead (held) while the store's
`grad_hold_bytes` allow: it waits there for its step, which takes it (`lend`), and never touches the
disk. The same flats are held every step (gradients arrive in the same order), so a flat's NVMe slot is
dropped when it is first held: it would hold an older step's gradient.

Where a `GradReplay` accepts a flat (its block's gradient can be computed again when its deferred step
runs), only the gradient's norm is kept (with one rank, read from the parameters' own gradients, which are
never copied into a flat: `owe_replay_of_params`): the step asks for the gradient again (`prepare_grad`), and the
recomputed one, handed over as backward's was, is held once its norm matches the one kept, so it neither waits on
NVMe nor in host memory through the step boundary.

A flat is trusted to that only after a trial: the first time it is accepted, its gradient goes the usual way
as well, and its step recomputes it and compares the two element by element. Equal (to rounding) on every
rank, later steps recompute it alone; otherwise the replay rejects its block for the rest of the run and the
step takes the gradient backward gave. A forward that does not repeat thus costs one step's gradient traffic,
not the run; one that stops repeating later is caught by the norm check, which stops the step.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import torch

from infinity.partition.flat_param import FlatParam
from infinity.shards.crossing import StagedCopy
from infinity.shards.grad_norm import flat_norm_sq, norm_sq, param_grads_norm_sq
from infinity.shards.kinds import ShardKind
from infinity.storage import ALIGN, Tier

GRADS_IN_FLIGHT = 1  # gradients crossing to the host not yet summed: each is summed while the next one copies
# a trial's |recomputed - backward's| / |backward's| allowed: rounding (a GPU's atomics), within two ulps of a 16-bit
# compute dtype, not a different gradient; a squared norm may then differ by twice as much (`_replay_rtol`)
REPLAY_TRIAL_RTOL = 1e-4
_TRIAL_CHUNK = 1 << 20  # elements compared at once (no whole-shard temporary)
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # gradient dtypes an fp32 flat holds exactly


class GradReplay(Protocol):
    """Recomputes the gradients of a flat's block for its deferred step (the engine's `GradientReplay`)."""

    def accepts(self, flat: FlatParam) -> bool:
        """`flat`'s final gradient, arriving now, can be recomputed when its step runs."""

    def replay(self, flat: FlatParam) -> None:
        """Recompute the gradients of `flat`'s block and hand them over as backward did (`accumulate_grad`)."""

    def reject(self, flat: FlatParam, why: str) -> None:
        """`flat`'s recomputed gradient was not backward's: accept no flat of its block again."""


class GradientAccumulators:
    """`ShardStore`'s gradient verbs; see the module docstring."""

    def grad_accumulator(self, flat: FlatParam) -> torch.Tensor | None:
        """The gradient accumulator where the compute may write into it directly (memory on its side), else
        None: gradients then come through `accumulate_grad`."""
        self._settle_before_grad(flat)
        if self.placement.grads_cross_to_host:
            return None
        return self.shard_view(flat, ShardKind.GRAD)

    def grad_written(self, flat: FlatParam, final: bool) -> None:
        """The caller wrote (or added) this micro-batch's gradient into `grad_accumulator(flat)` itself."""
        record = self.records[flat]  # (grad_accumulator settled what was owed: it is read first)
        record.has_grad = True
        if final and self.placement.needs_grad_norm:
            record.grad_norm_sq = flat_norm_sq(flat, self.shard_view(flat, ShardKind.GRAD))

    def accumulate_grad(self, flat: FlatParam, grad: torch.Tensor, final: bool) -> None:
        """Add one micro-batch's gradient shard (in the compute's memory) into the accumulator; `final` marks
        the last micro-batch before a step."""
        self._settle_before_grad(flat)
        if self.placement.grads_cross_to_host:
            self._grads_crossing.append((flat, final, self.crossing.grad_to_host(grad)))
            while len(self._grads_crossing) > GRADS_IN_FLIGHT:  # the next copy runs while this one is summed
                self._land_grad(*self._grads_crossing.popleft())
            return
        self._add_grad(flat, grad, final)

    def _settle_before_grad(self, flat: FlatParam) -> None:
        """A deferred step still reads the last step's gradient: settle it before a new one arrives, unless the
        arriving one is that gradient, recomputed for the step (`prepare_grad`)."""
        if flat not in self._replay_owed and flat not in self._replay_trials:
            self.settle(flat)

    def _land_grads(self) -> None:
        """Sum every gradient still crossing into its accumulator."""
        while self._grads_crossing:
            self._land_grad(*self._grads_crossing.popleft())

    def _land_grad(self, flat: FlatParam, final: bool, staged: StagedCopy) -> None:
        try:
            grad = staged.wait()
            if self.shard_view(flat, ShardKind.GRAD) is None:  # on NVMe: written from a copy that outlives `staged`
                dtype = self.placement.grad_dtype  # 4 KiB-aligned, so that the write reads it in place
                grad = self.comm.buffers.take(grad.numel(), dtype, torch.device("cpu"), align=ALIGN).copy_(grad)
            self._add_grad(flat, grad, final)
        finally:
            self.crossing.release(staged)

    def _add_grad(self, flat: FlatParam, grad: torch.Tensor, final: bool) -> None:
        """`accumulate_grad` of a gradient on the accumulator's side (host gradients in the compute dtype are
        promoted to fp32 as they are added; an NVMe slot holds `placement.grad_dtype`)."""
        record = self.records[flat]
        view = self.shard_view(flat, ShardKind.GRAD)
        if view is not None:
            grad = grad.to(view.device)
            if record.has_grad:
                view.add_(grad)
            else:
                view.copy_(grad)
            self.grad_written(flat, final)
            return
        grad = grad.to("cpu", self.placement.grad_dtype)
        if flat in self._replay_owed:  # the gradient recomputed for its step, arriving the way backward's did
            self._hold_replayed_grad(flat, grad)
            return
        if flat in self._replay_trials:  # recomputed for its trial: compared with the one kept, then dropped
            self._compare_trial(flat, grad)
            return
        if final and not record.has_grad and self.grad_replay is not None and self.grad_replay.accepts(flat):
            if flat in self._replay_trusted:
                self._owe_replay(flat, flat_norm_sq(flat, grad))
                return
            self._replay_trials[flat] = None  # kept the usual way below, and recomputed at its step to compare
        held = self._held_grads.get(flat)
        if held is not None:  # an earlier micro-batch's sum, in host memory
            held.add_(grad)
            if final and self.placement.needs_grad_norm:
                record.grad_norm_sq = flat_norm_sq(flat, held)
            return
        key = self.key(flat, ShardKind.GRAD)
        if record.has_grad:
            held = self.tiers.fetch(key, Tier.HOST).wait()
            try:
                held.add_(grad)
                self.tiers.write(key, held).wait()
                grad = held
                if final and self.placement.needs_grad_norm:
                    record.grad_norm_sq = flat_norm_sq(flat, held)
            finally:
                self.tiers.release(key, Tier.HOST)
                self.tiers.evict(key)  # one accumulator in host memory at a time (grad_accumulation_bytes)
            return
        if final and self.placement.needs_grad_norm:
            record.grad_norm_sq = flat_norm_sq(flat, grad)
        if self._hold_grad(flat, grad):
            record.has_grad = True
            return
        handle = self.tiers.write(key, grad) if key in self.tiers else self.tiers.put(key, grad, Tier.NVME)
        self._grad_writes.append((handle, grad, flat.name))  # the store may read `grad` until the write is done
        while len(self._grad_writes) > self.grad_writes_in_flight:
            self._finish_oldest_grad_write()
        record.has_grad = True

    def final_grad(self, flat: FlatParam, grad: torch.Tensor) -> torch.Tensor:
        """The step's whole gradient of `flat` (the accumulated earlier micro-batches plus `grad`), in host
        memory, for a step taken as it arrives; the accumulator is left empty. Where gradients cross from
        the device, the first micro-batch's comes in the compute dtype (the native Adam promotes it)."""
        self.settle(flat)
        self._land_grads()
        record = self.records[flat]
        if self.placement.grads_cross_to_host:
            staged = self.crossing.grad_to_host(grad)
            try:
                grad = staged.wait().clone()  # held by the stepper until stepped: not a pool buffer
            finally:
                self.crossing.release(staged)
        else:
            grad = self._host_fp32(grad)
        if record.has_grad:
            view = self._take_held_grad(flat)
            if view is not None:
                grad = view.to("cpu").add(grad)
            else:
                self.finish_grad_writes()
                key = self.key(flat, ShardKind.GRAD)
                try:
                    grad = self.tiers.fetch(key, Tier.HOST).wait().add(grad)
                finally:
                    self.tiers.release(key, Tier.HOST)
                    self.tiers.evict(key)
        record.has_grad = True  # consumed by the step as it arrives; zero_grad clears it
        return grad

    @staticmethod
    def _host_fp32(grad: torch.Tensor) -> torch.Tensor:
        return grad.to("cpu", torch.float32)

    def finish_grad_writes(self) -> None:
        """Sum the gradients still crossing from the device, and finish their writes to NVMe."""
        self._land_grads()
        while self._grad_writes:
            self._finish_oldest_grad_write()

    def _finish_oldest_grad_write(self) -> None:
        """Wait for the oldest gradient write, recorded as a stall on it (the training thread waits)."""
        handle, _, name = self._grad_writes.popleft()
        start = time.perf_counter_ns()
        handle.wait()
        self.prof.stall(name, start, time.perf_counter_ns(), "host->nvme")

    def local_grad_norm_sq(self) -> float:
        """Sum of squares of this rank's accumulated gradient shards; inf/nan if they overflowed."""
        self.finish_grad_writes()
        total = 0.0
        for flat, record in self.records.items():
            if not record.has_grad:
                continue
            if record.grad_norm_sq is None:  # no final micro-batch reached this flat: norm its sum now
                record.grad_norm_sq = flat_norm_sq(flat, self.read(flat, ShardKind.GRAD))
            total += record.grad_norm_sq
        return total

    def zero_grad(self) -> None:
        self._land_grads()
        for record in self.records.values():
            record.has_grad = False
            record.grad_norm_sq = None
        self.forget_grad_presence()
        for flat in [f for f in self._held_grads if not self.owes(f)]:  # a step owed still takes its gradient
            self._take_held_grad(flat)
        for flat in [f for f in self._replay_owed if not self.owes(f)]:
            del self._replay_owed[flat]
        for flat in [f for f in self._replay_trials if not self.owes(f)]:  # a skipped step's (fp16 overflow)
            del self._replay_trials[flat]

    # -- gradients recomputed for their step ---------------------------------------------------------

    def owe_replay_of_params(self, flat: FlatParam) -> bool:
        """`accumulate_grad` of `flat`'s final gradient, from its parameters' own gradients (one rank, host
        memory), where only its norm would be kept: its step gets it recomputed. Nothing is copied into a flat.
        False where the gradient is to come the usual way (having settled what `accumulate_grad` settles)."""
        if flat not in self._replay_trusted:
            return False
        self._settle_before_grad(flat)
        record = self.records[flat]
        exact = (self.placement.grad_dtype,) if self.placement.grad_dtype != torch.float32 else _EXACT_IN_FP32
        if (
            self.comm.world_size != 1
            or self.placement.grads_cross_to_host
            or self.shard_view(flat, ShardKind.GRAD) is not None
            or record.has_grad
            or flat in self._replay_owed
            or flat in self._replay_trials
            or any(g is not None and (g.device.type != "cpu" or g.dtype not in exact) for g in flat.grads())
            or not self.grad_replay.accepts(flat)
        ):
            return False
        self._owe_replay(flat, param_grads_norm_sq(flat))
        return True

    def _owe_replay(self, flat: FlatParam, grad_norm_sq: float) -> None:
        """Keep only the squared norm of `flat`'s final gradient: its step gets it recomputed (`prepare_grad`)."""
        record = self.records[flat]
        record.grad_norm_sq = grad_norm_sq
        record.has_grad = True
        self._replay_owed[flat] = record.grad_norm_sq
        key = self.key(flat, ShardKind.GRAD)
        if key in self.tiers:  # an older step's gradient (its block was not replayable then): nobody may read it
            self.tiers.drop(key)

    def prepare_grad(self, flat: FlatParam) -> None:
        """Have `flat`'s gradient in memory for its step if it is to be recomputed (`GradReplay.replay`); on
        its trial, recompute it and compare (the step then takes backward's, kept the usual way)."""
        if flat in self._replay_owed and flat not in self._held_grads:
            self.grad_replay.replay(flat)
            self._land_grads()
            if flat in self._replay_owed:
                raise RuntimeError(f"the gradient replay of {flat.name}'s block did not recompute {flat.name}")
        elif flat in self._replay_trials:
            self._run_trial(flat)

    def expects_replayed_grad(self, flat: FlatParam) -> bool:
        """A gradient recomputed now is one `flat`'s step asked for (or its trial): else it is not wanted (a flat
        of the replayed block whose step was not owed: no parameter of it got a gradient)."""
        return flat in self._replay_owed or flat in self._replay_trials

    def replays_owed(self) -> bool:
        """Some flat's gradient for the step owed is still to be recomputed (for the step, or its trial)."""
        return bool(self._replay_owed) or any(error is None for error in self._replay_trials.values())

    def _hold_replayed_grad(self, flat: FlatParam, grad: torch.Tensor) -> None:
        """The recomputed gradient of `flat` (host, `placement.grad_dtype`), held for its step once its squared
        norm matches the one backward's gave (the clipping used it); else it raises."""
        expected = self._replay_owed[flat]
        got = flat_norm_sq(flat, grad)
        if not math.isclose(got, expected, rel_tol=2 * self._replay_rtol(), abs_tol=1e-30):
            raise RuntimeError(
                f"the gradient of {flat.name} recomputed for its deferred step has squared norm {got:.9g}, backward's "
                f"had {expected:.9g}: its block's forward does not repeat (a random or stateful operation outside "
                "torch's RNG?); set 'zero_optimization.offload_optimizer.recompute_gradients' to false"
            )
        del self._replay_owed[flat]
        if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size() + 2 * ALIGN:  # a view (stage 1)
            grad = self.comm.buffers.take(grad.numel(), grad.dtype, grad.device).copy_(grad)
        self._held_grads[flat] = grad

    def _run_trial(self, flat: FlatParam) -> None:
        """Recompute `flat`'s block's gradients and compare each trial flat's with backward's: trusted where
        they agree on every rank, its block rejected where not (ranks decide alike: a replay's collectives
        run on all of them or none)."""
        self.finish_grad_writes()  # backward's gradients are read back to compare
        self.grad_replay.replay(flat)
        self._land_grads()
        compared = [f for f, error in self._replay_trials.items() if error is not None]
        if flat not in compared:
            raise RuntimeError(f"the gradient replay of {flat.name}'s block did not recompute {flat.name}")
        errors = torch.tensor([self._replay_trials.pop(f) for f in compared], dtype=torch.float64)
        errors = self.comm.all_reduce(errors.to(self.comm.device), "gradient replay trial", op="max").tolist()
        for f, error in zip(compared, errors, strict=True):
            if error <= self._replay_rtol():
                self._replay_trusted.add(f)
            else:
                why = f"its gradient recomputed on trial differed from backward's (relative error {error:.3g})"
                self.grad_replay.reject(f, why)

    def _replay_rtol(self) -> float:
        """How far a recomputed gradient may be from backward's, relative to its norm: its trial's bound, and half
        its squared norm's (the check that it still repeats)."""
        return max(REPLAY_TRIAL_RTOL, 2 * torch.finfo(self.placement.compute_dtype).eps)

    def _compare_trial(self, flat: FlatParam, grad: torch.Tensor) -> None:
        """Note how far `flat`'s recomputed gradient is from backward's (held, or read back from NVMe)."""
        kept = self._held_grads.get(flat)
        key = self.key(flat, ShardKind.GRAD)
        if kept is None:
            kept = self.tiers.fetch(key, Tier.HOST).wait()
        try:
            diff_sq = sum(
                float((a.to(torch.float32) - b).square_().sum(dtype=torch.float64))
                for a, b in zip(grad.split(_TRIAL_CHUNK), kept.split(_TRIAL_CHUNK), strict=True)
            )
            self._replay_trials[flat] = math.sqrt(diff_sq) / max(math.sqrt(norm_sq(kept)), 1e-30)
        finally:
            if flat not in self._held_grads:
                self.tiers.release(key, Tier.HOST)  # (stays cached for the step, which reads it next)

    # -- gradients held in host memory -------------------------------------------------------------

    @property
    def held_grad_bytes(self) -> int:
        """Bytes of gradient sums held in host memory instead of their NVMe home."""
        return sum(g.numel() * g.element_size() for g in self._held_grads.values())

    def _hold_grad(self, flat: FlatParam, grad: torch.Tensor) -> bool:
        """Keep `flat`'s first gradient of the step (host, `placement.grad_dtype`) in memory, if the hold allows."""
        nbytes = grad.numel() * grad.element_size()
        if self.held_grad_bytes + nbytes > self.grad_hold_bytes:
            return False
        if grad.untyped_storage().nbytes() > nbytes + 2 * ALIGN:  # a view of a larger buffer (a reduction's)
            # copied into the group's kept memory: fresh pages each step cost the kernel's zeroing
            grad = self.comm.buffers.take(grad.numel(), grad.dtype, grad.device).copy_(grad)
        key = self.key(flat, ShardKind.GRAD)
        if key in self.tiers:  # its slot holds an older step's gradient: nobody may read that
            self.tiers.drop(key)
        self._held_grads[flat] = grad
        return True

    def _grad_in_memory(self, flat: FlatParam) -> torch.Tensor | None:
        """The gradient sum where it is in memory: the accumulator's home there, or a held sum."""
        view = self.shard_view(flat, ShardKind.GRAD)
        if view is None:
            self.prepare_grad(flat)
        return view if view is not None else self._held_grads.get(flat)

    def _take_held_grad(self, flat: FlatParam) -> torch.Tensor | None:
        """`_grad_in_memory`; a held sum is handed over (whoever takes it, a step, frees it)."""
        view = self.shard_view(flat, ShardKind.GRAD)
        if view is None:
            self.prepare_grad(flat)
        return view if view is not None else self._held_grads.pop(flat, None)
