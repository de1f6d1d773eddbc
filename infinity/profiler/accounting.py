"""Memory accounting: the peaks of live bytes per tier against the store's own high-water marks.

`live` records are the store's live bytes per tier after a change; `peak` records the store's
high-water mark over each step. Recorded at every change, the live series reaches the high-water
mark; sampled (at phase changes, say) it can miss it, and `problems` says by how much. `held`
records split a tier's live bytes by holder; `rss` samples say how much the process holds in all,
the store's tiers and everything outside them (autograd's tensors, staging copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinity.profiler.traces import RankTrace

PEAK_MATCH = 0.9  # the live series must reach this share of the store's high-water mark
SPARSE_PER_STEP = 4  # live records per step and tier at most this many: sampled, not every change


@dataclass
class Accounting:
    """Per tier (and holder) the highest value of any rank; RSS of the rank that grew most."""

    live_peak: dict[str, int] = field(default_factory=dict)
    store_peak: dict[str, int] = field(default_factory=dict)
    held_peak: dict[str, dict[str, int]] = field(default_factory=dict)
    live_changes: int = 0  # live records in the window, all ranks
    tier_steps: int = 0  # (rank, step, tier) triples with live records
    rss_start: int | None = None  # at the first recorded step's start
    rss_peak: int | None = None

    def problems(self) -> list[str]:
        """Tiers whose live series misses the store's high-water mark, in words; without high-water marks,
        a live series too sparse to hold the peaks (a few samples a step)."""
        out = []
        if not self.store_peak and self.tier_steps and self.live_changes <= SPARSE_PER_STEP * self.tier_steps:
            out.append(
                f"live bytes were sampled {self.live_changes / self.tier_steps:.1f} times per step and tier "
                "(at phase changes), not recorded at every change, and the trace has no high-water marks: the "
                "peaks in the memory lines and live_bytes.png are lower bounds"
            )
        for tier, peak in sorted(self.store_peak.items()):
            live = self.live_peak.get(tier, 0)
            if peak and live < PEAK_MATCH * peak:
                out.append(
                    f"live bytes on {tier} peak at {live / 1e9:.3f} GB in the trace but the store's high-water mark "
                    f"is {peak / 1e9:.3f} GB: live bytes were sampled ({self.live_changes} records), not recorded "
                    "at every change, so peaks between samples are missing"
                )
        return out


def _max_into(table: dict, key: str, value: int) -> None:
    table[key] = max(table.get(key, 0), value)


def account(traces: list[RankTrace]) -> Accounting:
    out = Accounting()
    growth = None
    for trace in traces:
        for r in trace.of("live"):
            _max_into(out.live_peak, r["tier"], r["bytes"])
            out.live_changes += 1
        out.tier_steps += len(trace.steps()) * len({r["tier"] for r in trace.of("live")})
        for r in trace.of("peak"):
            _max_into(out.store_peak, r["tier"], r["bytes"])
        for r in trace.of("held"):
            _max_into(out.held_peak.setdefault(r["tier"], {}), r["holder"], r["bytes"])
        rss = sorted((r["t_ns"], r["bytes"]) for r in trace.of("rss"))
        if rss:
            start, peak = rss[0][1], max(b for _, b in rss)
            if growth is None or peak - start > growth:
                growth, out.rss_start, out.rss_peak = peak - start, start, peak
    return out
