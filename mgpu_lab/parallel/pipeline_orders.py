"""Pipeline schedules as data: the order of a rank's actions, and a noiseless replay of them.

An action is ``("F", k)`` (the forward of micro-batch k) or ``("B", k)`` (its
backward) of the rank's only stage, or ``("F", k, s)`` / ``("B", k, s)`` of stage s
when a rank holds several stages (stage s on rank ``s % num_ranks``, torch's loop
placement). A schedule is one order per rank:

* ``gpipe_order``: every forward, then every backward. A stage holds the
  activations of all m micro-batches at the turn.
* ``one_f_one_b_order``: ``p - i`` forwards (warm-up), then one backward, one
  forward, then the remaining backwards. The same bubble, at most ``p - i`` held.
* ``interleaved_1f1b_order``: v stages per rank (rank r runs stages r, r + p, ...):
  torch's ``ScheduleInterleaved1F1B``, action for action. Each stage is 1/v of the
  work, so filling and draining take ``p - 1`` small steps: the bubble is
  ``(p-1)/(v·m + p - 1)``, for v times the messages and more activations in flight.

With equal stages (forward tF, backward tB) GPipe and 1F1B last ``(m + p - 1)(tF + tB)``,
of which each rank computes ``m(tF + tB)``: the bubble is ``(p-1)/(m+p-1)``.
``simulate_timeline`` replays orders on stages of a fixed speed (per stage if you
like) and ``bubble_fraction`` measures its idle time, or that of recorded spans.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence, Tuple, Union

Action = Tuple  # ("F" | "B", micro-batch) or ("F" | "B", micro-batch, stage)


def gpipe_order(stage_index: int, num_stages: int, n_microbatches: int) -> List[Action]:
    """GPipe: all forwards, then all backwards (in the same order)."""
    return [("F", k) for k in range(n_microbatches)] + [("B", k) for k in range(n_microbatches)]


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> List[Action]:
    """1F1B: ``num_stages - stage_index`` forwards (warm-up), then one backward, one
    forward, ... (steady state), then the remaining backwards (cool-down)."""
    warmup = min(n_microbatches, num_stages - stage_index)
    order = [("F", k) for k in range(warmup)]
    forward, backward = warmup, 0
    while forward < n_microbatches:
        order += [("B", backward), ("F", forward)]
        forward, backward = forward + 1, backward + 1
    return order + [("B", k) for k in range(backward, n_microbatches)]


def interleaved_1f1b_order(rank: int, num_ranks: int, n_local_stages: int, n_microbatches: int) -> List[Action]:
    """Rank ``rank``'s actions ``(kind, k, stage)`` under interleaved 1F1B (torch's order).

    The micro-batches go in rounds of ``m // rounds`` (``rounds = max(1, m // p)``, m a
    multiple of it): a rank runs a round's forwards on its first stage, then on its
    second, ... (depth first), and its backwards the other way round. Warm-up: the
    last rank runs ``(v - 1)`` rounds of forwards, each rank before it 2 more.
    """
    p, v, m = num_ranks, n_local_stages, n_microbatches
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"interleaved 1F1B needs a number of micro-batches that is a multiple of its number of "
                         f"rounds, max(1, m // p) = {rounds}; got m = {m} for p = {p}")
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady = m * v - warmup
    next_f: Dict[int, int] = defaultdict(int)
    next_b: Dict[int, int] = defaultdict(int)
    order: List[Action] = []

    def forward(op):
        stage = (op // per_round) % v * p + rank
        order.append(("F", next_f[stage], stage))
        next_f[stage] += 1

    def backward(op):
        stage = (v - 1 - (op - warmup) // per_round % v) * p + rank
        order.append(("B", next_b[stage], stage))
        next_b[stage] += 1

    for op in range(2 * warmup + steady):
        if op < warmup:
            forward(op)
        elif op < warmup + steady:
            forward(op)
            backward(op)
        else:
            backward(op)
    return order


def _stage_of(action: Action, rank: int) -> int:
    return action[2] if len(action) > 2 else rank


def check_order(order: List[Action], n_microbatches: int, backward: bool = True) -> None:
    """A usable order runs each micro-batch's forward once, and its backward once, after it
    (``backward=False``: forwards only), on each stage it names."""
    done = set()
    stages = {_stage_of(a, 0) for a in order if isinstance(a, tuple) and len(a) in (2, 3)} or {0}
    for action in order:
        if not isinstance(action, tuple) or len(action) not in (2, 3) or action[0] not in ("F", "B") \
                or not isinstance(action[1], int) or not 0 <= action[1] < n_microbatches:
            raise ValueError(f"bad action {action!r}: expected ('F' or 'B', micro-batch in 0..{n_microbatches - 1})"
                             " or the same with a stage, (kind, micro-batch, stage)")
        if action in done:
            raise ValueError(f"{action!r} appears twice in the order")
        if action[0] == "B" and ("F",) + action[1:] not in done:
            raise ValueError(f"{action!r} comes before {('F',) + action[1:]!r}: a backward needs its forward first")
        done.add(action)
    kinds = "FB" if backward else "F"
    shape = (lambda kind, k, s: (kind, k)) if all(len(a) == 2 for a in order) else (lambda kind, k, s: (kind, k, s))
    missing = [shape(kind, k, s) for s in sorted(stages) for kind in kinds for k in range(n_microbatches)
               if shape(kind, k, s) not in done]
    if missing:
        raise ValueError(f"the order never runs {missing}")


def held_microbatches(timeline: List[Action]) -> int:
    """The most micro-batches (of any of the rank's stages) whose activations it held at once:
    forward run, backward not yet."""
    held = peak = 0
    for action in timeline:
        held += 1 if action[0] == "F" else -1
        peak = max(peak, held)
    return peak


Times = Union[float, Sequence[float]]


def simulate_timeline(orders: List[List[Action]], forward_time: Times = 1.0,
                      backward_time: Times = 2.0) -> List[List[Tuple]]:
    """When each action of ``orders`` (one order per rank, rank r's at index r) runs on
    stages of a fixed speed whose messages take no time: per rank, the actions with their
    ``(start, end)`` appended, ``(kind, k, start, end)`` or ``(kind, k, stage, start, end)``.

    Each rank runs its order in turn; a forward of stage s waits for stage s - 1's forward
    of the same micro-batch, a backward for stage s + 1's backward (the last stage's for
    its own forward). ``forward_time``/``backward_time``: one number, or one per stage
    (a slow stage). A replay of the schedule without noise (what the recorded ``spans``
    of a real run approach); raises ValueError when the orders wait on each other forever.
    """
    p = len(orders)
    num_stages = max([p] + [a[2] + 1 for o in orders for a in o if len(a) > 2])

    def cost(times, stage):
        return times[stage] if isinstance(times, (list, tuple)) else times

    done: Dict[Tuple[str, int, int], float] = {}   # (kind, k, stage) -> end time
    out: List[List[Tuple]] = [[] for _ in range(p)]
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                action = tuple(orders[r][nxt[r]])
                kind, k, s = action[0], action[1], _stage_of(action, r)
                dep = ("F", k, s - 1) if kind == "F" else ("B", k, s + 1) if s < num_stages - 1 else ("F", k, s)
                if kind == "F" and s == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                start = max(free[r], ready)
                free[r] = done[(kind, k, s)] = start + cost(forward_time if kind == "F" else backward_time, s)
                out[r].append(action + (start, free[r]))
                nxt[r] += 1
                moved = True
        if not moved:
            waiting = {r: orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])}
            raise ValueError(f"the orders wait on each other forever: next actions per rank {waiting}")
    return out


def bubble_fraction(spans: List[List[Tuple[float, float]]]) -> float:
    """The idle fraction of a step, averaged over ranks: ``spans[i]`` holds rank i's
    (start, end) compute times; the step runs from the earliest start to the latest end."""
    begin = min(a for stage in spans for a, _ in stage)
    length = max(b for stage in spans for _, b in stage) - begin
    return sum(1 - sum(b - a for a, b in stage) / length for stage in spans) / len(spans)
