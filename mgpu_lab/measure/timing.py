"""Timing for benchmarks: the median of N timed steps, and one way to print the results.

Every script in ``benchmarks/`` measures the same way::

    times = median_times({"mine": step_a, "torch": step_b}, repeats=20, warmup=3)
    table = Table("step time", {"contender": "", "ms": ".2f", "vs torch": ".2f"})
    for name, t in times.items():
        table.add(name, t * 1e3, t / times["torch"])
    table.print()
    print_json("bench_x", tables=[table], ratio=...)   # the last line: one JSON object

Why these choices:

* **median**, not mean: one step slowed by another process on a shared machine
  does not move it.
* **warm-up** steps first, untimed: the first calls pay for allocator growth,
  lazy initialisation, connection set-up.
* **interleaved**: the contenders take turns, step by step, so a load that
  drifts during the run hits every contender alike (a ratio measured side by
  side means something; two separate runs do not).
* **CUDA synchronisation** before starting and before stopping the clock: GPU
  work is asynchronous, and without it the clock measures only the launch of
  the kernels. ``before`` runs before each timed step (``dist.barrier`` makes
  every rank start a step together).
* **clock**: wall time (``time.perf_counter``) by default; ``clock=time.process_time``
  counts only this process's CPU time, which other programs on a shared CPU machine
  do not inflate (single-threaded CPU work only: it misses time spent waiting).
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch


def synchronize(device: Optional[torch.device] = None) -> None:
    """Wait for ``device``'s queued GPU work; ``None``: every GPU this process has used."""
    if not torch.cuda.is_initialized():  # no GPU work was ever queued
        return
    if device is not None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def median_times(steps: Mapping[str, Callable[[], Any]], repeats: int = 10, warmup: int = 1,
                 device: Optional[torch.device] = None,
                 before: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Median seconds per call of each step (read on ``clock``), the steps interleaved, after ``warmup`` untimed rounds."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"median_times: repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for round_ in range(warmup + repeats):
        for name, step in steps.items():
            if before is not None:
                before()
            synchronize(device)
            start = clock()
            step()
            synchronize(device)
            if round_ >= warmup:
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def median_time(step: Callable[[], Any], repeats: int = 10, warmup: int = 1,
                device: Optional[torch.device] = None, before: Optional[Callable[[], Any]] = None,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds per call of one step."""
    return median_times({"step": step}, repeats, warmup, device, before, clock)["step"]


class Table:
    """A benchmark's table: named columns, each with a format spec (``".2f"``, ``""``).

    The first column is text, left-aligned; the others right-aligned.
    """

    def __init__(self, title: str, columns: Mapping[str, str]):
        self.title, self.columns = title, dict(columns)
        self.rows: List[Sequence[Any]] = []

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"Table {self.title!r}: {len(values)} values for columns {list(self.columns)}")
        self.rows.append(values)

    def _cells(self, values: Sequence[Any]) -> List[str]:
        return [format(v, spec) if v is not None else "-" for v, spec in zip(values, self.columns.values())]

    def print(self) -> None:
        cells = [self._cells(row) for row in self.rows]
        widths = [max([len(name)] + [len(c[i]) for c in cells]) for i, name in enumerate(self.columns)]

        def line(parts):
            return "  ".join(p.ljust(w) if i == 0 else p.rjust(w) for i, (p, w) in enumerate(zip(parts, widths)))

        print(f"\n{self.title}")
        print(line(list(self.columns)))
        print(line(["-" * w for w in widths]))
        for c in cells:
            print(line(c))

    def as_records(self) -> List[Dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


def print_json(benchmark: str, tables: Sequence[Table] = (), **summary: Any) -> None:
    """The last line of every benchmark: one JSON object, for tools and for docs/BENCHMARKS.md."""
    record = {"benchmark": benchmark, **summary,
              "tables": {t.title: t.as_records() for t in tables}}
    print(json.dumps(record, default=str))
