"""The probe's results are saved at the end of the probe itself (grading/snapshot.py): a
thread the learner started cannot change what the judge sees, and the report says it ran."""
import json

import torch

from mgpu_lab.cli import main as cli
from mgpu_lab.course.grading import snapshot
from test_grader import DATA, UNSANDBOXED_IF_NEEDED, toy, write

# An exercise cell that starts a thread: it waits for the probe's `mine`, empties it in
# place when it is a list (mul's check) and rebinds it (add's), again and again.
SPOILER = '''import threading, time
def add(a, b):
    return a + b
def _spoil():
    global mine
    while True:
        try:
            seen = mine
        except NameError:
            seen = None
        if seen is not None and seen != -2:
            if isinstance(seen, list):
                seen.clear()
            mine = -2
        time.sleep(0.001)
threading.Thread(target=_spoil, name="spoiler <b>", daemon=True).start()'''


def test_a_thread_that_rewrites_the_probes_results_changes_nothing_and_is_reported(tmp_path):
    write(toy(add=SPOILER), tmp_path / "class" / "sly.ipynb")
    out = tmp_path / "feedback"
    assert cli(["grade", str(tmp_path / "class"), "--solutions", str(DATA / "solutions"),
                "--timeout", "30", "--memory", "2", "--quiet", "--json", str(tmp_path / "g.json"),
                "--feedback", str(out)] + UNSANDBOXED_IF_NEEDED) == 0
    [nb] = json.loads((tmp_path / "g.json").read_text())["notebooks"]
    assert {e["grade_id"]: (e["score"], e["error"]) for e in nb["exercises"]} == {
        "add_test": (2, None), "mul_test": (3, None)}, nb["exercises"]
    notes = [n for n in nb["notes"] if "still running" in n]
    assert len(notes) == 2 and "a thread your code started (spoiler ?b?) was still running" in notes[0]
    feedback = (out / "sly" / "toy.md").read_text()
    assert "still running when the check's probe ended" in feedback and "<b>" not in feedback


def test_the_snapshot_copies_plain_data_within_its_limits(tmp_path):
    x = torch.arange(12.0).reshape(3, 4)
    ns = {"views": [x.t(), x[1], {"k": (1, 2.5, "s")}], "p": torch.nn.Parameter(torch.ones(2)),
          "empty": torch.empty(0, 3), "big": torch.zeros(1000), "small": torch.ones(3)}
    snapshot.take(ns, ["views", "p", "empty", "big", "small", "unbound"], str(tmp_path), 2000)
    saved = {p.stem for p in tmp_path.glob("*.pt")}
    assert saved == {"views", "p", "empty", "small"}        # big: past the limit; the next fits
    views = torch.load(tmp_path / "views.pt", weights_only=True)
    assert torch.equal(views[0], x.t()) and views[0].stride() == (1, 4) and views[2] == ns["views"][2]
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
    x.zero_()                                               # the copy is the snapshot's own
    assert views[1].tolist() == [4.0, 5.0, 6.0, 7.0]
    p = torch.load(tmp_path / "p.pt", weights_only=True)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    running = snapshot.running_threads()                    # pytest's own, if any
    assert json.loads((tmp_path / snapshot.THREADS_FILE).read_text()) == {
        "running": len(running), "names": [snapshot.clean_name(t.name) for t in running][:5]}


def test_a_thread_polling_every_millisecond_never_gets_in_before_the_snapshot(tmp_path):
    """30 probes in one kernel, each snapshotted while a thread polls for `mine` every
    millisecond and empties it: every snapshot holds the probe's value. (A fork at the
    probe's end did worse: 13 of 30, its hooks let the thread run first.)"""
    from nbformat.v4 import new_code_cell, new_notebook
    from mgpu_lab.course.grading.kernel import run_notebook
    spoil = ("import threading, time\nimport mgpu_lab.course.grading.snapshot as S\n"
             "def _spoil():\n    global mine\n    while True:\n        seen = globals().get('mine')\n"
             "        if isinstance(seen, list) and seen != [-1]:\n            seen.clear()\n"
             "            seen.append(-1)\n            mine = [-2]\n        time.sleep(0.001)\n"
             "threading.Thread(target=_spoil, daemon=True).start()")
    cells = [new_code_cell(spoil)]
    for i in range(30):
        (tmp_path / str(i)).mkdir()
        cells.append(new_code_cell(f"x = sum(range(20000))\nmine = [5, {i}]\n"
                                   f"S.take(globals(), ['mine'], {str(tmp_path / str(i))!r}, 10**6)"))
    results = run_notebook(new_notebook(cells=cells), cwd=tmp_path, progress=False)
    assert all(r.error is None for r in results), results
    got = [torch.load(tmp_path / str(i) / "mine.pt", weights_only=True) for i in range(30)]
    assert got == [[5, i] for i in range(30)]
    assert all(json.loads((tmp_path / str(i) / snapshot.THREADS_FILE).read_text())["running"] == 1
               for i in range(30))
