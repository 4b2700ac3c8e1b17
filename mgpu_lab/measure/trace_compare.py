"""Comparing ranks' sequences of collectives: the first place where they disagree.

Pure functions over the records ``collective_trace`` makes (one dict per call:
``op``, ``shape``, ``dtype``, ``root``, ``where``), so a report can be computed
anywhere, and tested without processes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}  # recorded, never compared
_END = "<end>"  # the record a rank publishes when it leaves the traced region


@dataclass
class Divergence:
    """The first collective (index into the compared sequences) where ranks disagree.
    ``calls[rank]`` is that rank's record there, or None if it made no such call."""

    index: int
    calls: Dict[int, Optional[dict]]
    diverging_ranks: List[int] = field(default_factory=list)


def describe(record: Optional[dict]) -> str:
    """``all_reduce(shape=[4], float32)``, ``broadcast(shape=[2], float32, root=0)``, ``barrier()``."""
    if record is None or record["op"] == _END:
        return "(no call)" if record is None else "(none: it left the traced region)"
    parts = [f"shape={record['shape']}" if record.get("shape") is not None else "", record.get("dtype") or "",
             f"root={record['root']}" if record.get("root") is not None else ""]
    return f"{record['op']}({', '.join(p for p in parts if p)})"


def _key(record: Optional[dict]):
    if record is None:
        return None
    return (record["op"], json.dumps(record.get("shape")), record.get("dtype"), record.get("root"))


def first_divergence(traces: Dict[int, List[dict]]) -> Optional[Divergence]:
    """Compare ranks' sequences of (non point-to-point) collectives; None if they all match.

    A rank whose sequence is shorter and did not end has simply not got there yet
    (it may be stuck before it): it counts as making no call. The diverging ranks
    are the smaller group when one group is smallest, else every rank.
    """
    seqs = {rank: [r for r in recs if r["op"] not in P2P] for rank, recs in traces.items()}
    for i in range(max((len(s) for s in seqs.values()), default=0)):
        calls = {rank: (s[i] if i < len(s) else None) for rank, s in sorted(seqs.items())}
        if len({_key(c) for c in calls.values()}) > 1:
            groups: Dict[Any, List[int]] = {}
            for rank, call in calls.items():
                groups.setdefault(_key(call), []).append(rank)
            sizes = sorted(len(g) for g in groups.values())
            smallest = [g for g in groups.values() if len(g) == sizes[0]]
            diverging = smallest[0] if len(smallest) == 1 and sizes[0] < sizes[-1] else sorted(calls)
            return Divergence(i, calls, diverging)
    return None


def format_report(traces: Dict[int, List[dict]]) -> Tuple[str, Optional[Divergence]]:
    """The text ``CollectiveError`` carries: the first disagreement and where every rank is."""
    div = first_divergence(traces)
    lines = []
    if div is None:
        n = min((len([r for r in t if r["op"] not in (_END, *P2P)]) for t in traces.values()), default=0)
        lines.append(f"collective trace: the ranks agree on their first {n} collective(s); no mismatch recorded "
                     "(a rank may be slow, or stuck outside any collective: read the stacks)")
    else:
        who = ", ".join(f"rank {r}" for r in div.diverging_ranks)
        lines.append(f"collective trace: ranks disagree at collective #{div.index} (all earlier ones matched); "
                     f"diverging: {who}")
        for rank, call in div.calls.items():
            where = f"  at {call['where']}" if call and call.get("where") else ""
            lines.append(f"  rank {rank}: {describe(call) if call else '(no call yet: still running, or stuck before it)'}{where}")
    for rank in sorted(traces) if div is None else ():  # no mismatch: say where each rank got to
        recs = [r for r in traces[rank] if r["op"] != _END]
        ended = bool(traces[rank]) and traces[rank][-1]["op"] == _END
        last = f", the last: {describe(recs[-1])}" if recs else ""
        lines.append(f"  rank {rank}: {len(recs)} call(s) recorded{last}"
                     f"{'; it left the traced region' if ended else ''}")
    return "\n".join(lines), div
