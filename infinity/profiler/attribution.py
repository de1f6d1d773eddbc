"""What a stall really waited on, from the moves that ended during it.

The engine records a stall with what it expected to wait for ("all-gather" for a prefetched block,
"nvme->host" for one read on use). A gather is a chain: the shard's read from NVMe, its copy to the
device, then (with several ranks) the all-gather. `attribute_stalls` splits each stall at the ends of
its block's moves in the same direction that finished inside it: the time up to a move's end was spent
waiting for that move; the rest goes to a collective of the block in flight then (several ranks), else
to the recorded label; at one rank, where nothing is communicated, to the last move's stage (or, with
no move, a collective label becomes the gather's first move, `format.gather_source`).
"""

from __future__ import annotations

from collections import defaultdict

from infinity.profiler.format import COLLECTIVE_OPS, OPTIMIZER_STEP_WAIT, REDUCTION_OPS, gather_source, tier_pair
from infinity.profiler.traces import RankTrace, Record

TOWARD_COMPUTE = ("nvme->host", "nvme->device", "host->device")


def block_name(name: str) -> str:
    """A block's name as stalls spell it: a flat parameter's "<block>#<group>" without its group."""
    return name.split("#", 1)[0]


def _inbound(waited_on: str) -> bool:
    return waited_on in COLLECTIVE_OPS or waited_on in TOWARD_COMPUTE


def _pieces(stall: Record, moves: list[Record], collectives: list[Record], one_rank: bool, fallback: str) -> list:
    start, end, label = stall["start_ns"], stall["end_ns"], stall["waited_on"]
    inbound = _inbound(label)
    cursor, pieces = start, []
    for m in moves:
        pair = tier_pair(m["src"], m["dst"])
        if (pair in TOWARD_COMPUTE) != inbound or not start < m["end_ns"] <= end or m["end_ns"] <= cursor:
            continue
        pieces.append([cursor, m["end_ns"], pair])
        cursor = m["end_ns"]
    if cursor < end:
        rest = label
        if one_rank and (pieces or label in COLLECTIVE_OPS):  # nothing is communicated: the last stage's time
            rest = pieces[-1][2] if pieces else fallback
        elif pieces:
            ops = [c["op"] for c in collectives if c["start_ns"] < end and c["end_ns"] > cursor]
            rest = ops[-1] if ops else label
        pieces.append([cursor, end, rest])
    merged: list[list] = []
    for piece in pieces:
        if merged and merged[-1][2] == piece[2]:
            merged[-1][1] = piece[1]
        else:
            merged.append(piece)
    return merged


def attribute_stalls(traces: list[RankTrace]) -> int:
    """Replace each trace's stall records by their attributed pieces (see the module doc), in place.

    Returns how many stalls changed. Idempotent: attributed pieces attribute to themselves.
    """
    changed = 0
    for trace in traces:
        one_rank = int(trace.meta.get("world_size", 1)) == 1
        fallback = gather_source(trace.settings)
        moves: dict[str, list[Record]] = defaultdict(list)
        for m in trace.of("move"):
            moves[block_name(m["block"])].append(m)
        for block_moves in moves.values():
            block_moves.sort(key=lambda m: m["end_ns"])
        collectives: dict[str, list[Record]] = defaultdict(list)
        for c in trace.of("collective"):
            collectives[block_name(c["block"])].append(c)
        out: list[Record] = []
        for stall in trace.of("stall"):
            if stall["waited_on"] in ("pool", OPTIMIZER_STEP_WAIT, *REDUCTION_OPS):  # not a gather's: as labelled
                out.append(stall)
                continue
            block = block_name(stall["block"])
            pieces = _pieces(stall, moves.get(block, []), collectives.get(block, []), one_rank, fallback)
            if len(pieces) == 1 and pieces[0][2] == stall["waited_on"]:
                out.append(stall)
                continue
            changed += 1
            for start, end, waited_on in pieces:
                out.append({**stall, "start_ns": start, "end_ns": end, "waited_on": waited_on})
        if trace.of("stall"):
            trace.records["stall"] = out
    return changed
