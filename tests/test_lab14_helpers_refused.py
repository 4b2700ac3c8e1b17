"""Lab 14's ring-attention exercises refuse the library's private helpers (issue 47 finding 10).

``mgpu_lab.parallel.context_parallel`` is importable, and its helpers put together right (``_attend`` on the rows a
block has work for, with the window's mask, ``_merge``, ``_attend_backward``; ``_Exchange`` for the ring) answer
exercise 2 with the right numbers: only the "must not call" guard refuses them (a courtesy: docs/INSTRUCTORS.md's
honour-level table). This keeps them named in the graded cells' ``reimplements`` and seen by the static pass,
import aliases included; the mutants (tests/mutants/lab14_context_parallel.py) hold the uses the numbers reject.
"""
import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "solutions" / "14_context_parallel.ipynb"
CP = "mgpu_lab.parallel.context_parallel."


def _with_answer(solution, grade_id, source):
    from mgpu_lab.course.notebook.cells import exercise_of
    cheat = nbformat.from_dict(json.loads(json.dumps(solution)))
    cell = next(c for c in cheat.cells if c.metadata.get("nbgrader", {}).get("grade_id") == exercise_of(cheat)[grade_id])
    cell.source = source(cell.source)
    return cheat


def test_the_library_helpers_are_refused_in_both_ring_exercises():
    from mgpu_lab.course.grading.guard import notebook_violations as static_check
    solution = nbformat.read(LAB, as_version=4)
    assert static_check(solution, solution) == {}
    helpers = ("from mgpu_lab.parallel.context_parallel import _attend as block, _merge, _attend_backward\n"
               "import mgpu_lab.parallel.context_parallel as cp\n"
               "steps = block, _merge, _attend_backward\n")
    ring = _with_answer(solution, "window_ring_attention_test", lambda s: helpers + s.replace(
        "wait = ring_pass(kv)", "wait = cp._Exchange(kv, None).wait"))
    found = static_check(ring, solution).get("window_ring_attention_test", [])
    assert {CP + n for n in ("_attend", "_merge", "_attend_backward", "_Exchange")} <= set(found), found
    online = _with_answer(solution, "online_attention_test", lambda s: helpers + s)
    found = static_check(online, solution).get("online_attention_test", [])
    assert {CP + "_attend", CP + "_merge"} <= set(found), found
