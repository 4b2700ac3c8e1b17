"""The trusted side of grading, without kernels: a graded cell's three parts, the judge
process, and the static pass that reports tampering.

End to end (a real kernel, real labs, every exercise's mutants) is tests/test_mutants.py.
"""
import base64
import io
import os
import pickle
import textwrap

import nbformat
import pytest
import torch

from mgpu_lab.course.notebook import graded_cell
from mgpu_lab.course.grading.judge import JudgeError, JudgeProcess, dumps, loads
from mgpu_lab.course.notebook.notebooks import MarkerError, check_notebook, make_lab
from mgpu_lab.course.grading.tamper import findings, tampering
from conftest import ROOT

CELL = """torch.manual_seed(0)
x = torch.randn(4)
### PROBE: your code
mine = f(x)
### JUDGE: here
assert torch.equal(mine, x * 2), "f doubles"
"""


# --- the three parts -------------------------------------------------------------

def test_split_keeps_line_numbers_and_bound_names():
    parts = graded_cell.split(CELL)
    assert parts.inputs.strip().endswith("x = torch.randn(4)")
    assert parts.probe.splitlines()[3] == "mine = f(x)" and parts.probe.strip() == "mine = f(x)"
    assert parts.judge.splitlines()[5].startswith("assert torch.equal")  # line 6 of the cell
    assert graded_cell.bound_names(parts.inputs) == ["x"]
    assert graded_cell.bound_names(parts.probe) == ["mine"]
    src = ("import math as m\nfor i, (a, *b) in enumerate([]):\n    c = 1\nwith open(p) as fh:\n"
           "    pass\ndef g():\n    local = 1\nk = [z for z in range(3)]\nq[0] = 1\nw.attr = 2\n"
           "try:\n    pass\nexcept Exception as err:\n    pass\nclass K:\n    inside = 1\n")
    assert graded_cell.bound_names(src) == ["m", "i", "a", "b", "c", "fh", "g", "k", "err", "K"]
    # IPython syntax, read as the kernel runs it: a %%writefile cell binds nothing, a magic line nothing
    assert graded_cell.bound_names("%%writefile s.py\nx = 1\n") == []
    assert graded_cell.bound_names("%matplotlib inline\ny = 2\n") == ["y"]


@pytest.mark.parametrize("source, why", [
    ("assert f(1) == 2", "found 0 and 0"),
    ("### PROBE\nx = 1\n### PROBE\n### JUDGE\n", "found 2 and 1"),
    ("### JUDGE\nx = 1\n### PROBE\n", "comes before"),
])
def test_a_graded_cell_without_its_markers_is_refused_by_labs_build(source, why):
    with pytest.raises(ValueError, match=why):
        graded_cell.split(source)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source, metadata={
        "nbgrader": {"grade_id": "t", "grade": True, "points": 1}})])
    with pytest.raises(MarkerError, match="cell 0 \\(t\\)"):
        check_notebook(nb)


# --- the judge process -------------------------------------------------------------

@pytest.fixture()
def judge(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    j = JudgeProcess(env, str(tmp_path), timeout=60)
    j.setup(["import torch", "%matplotlib inline\nscale = 2"])
    yield j
    j.close()


def test_the_judge_sends_plain_inputs_and_decides_on_plain_answers(judge):
    ship, drop = judge.inputs("t", "x = torch.arange(3.0)\nnet = torch.nn.Linear(2, 2)\n"
                                   "spec = {'n': 3, 'name': 'a', 'shape': (2, 2)}\n")
    assert sorted(ship) == ["spec", "x"] and drop == ["net"]      # a module does not cross
    assert torch.equal(loads(ship["x"]), torch.arange(3.0))
    judge_part = "assert torch.equal(mine, x * scale) and isinstance(net, torch.nn.Linear)"
    assert judge.verdict("t", judge_part, {"mine": dumps(torch.arange(3.0) * 2)}, []).ok
    judge.inputs("t", "x = torch.arange(3.0)")
    reply = judge.verdict("t", "\nassert torch.equal(mine, x * scale), 'f doubles'",
                          {"mine": dumps(torch.zeros(3))}, [])
    assert (reply.ok, reply.error, reply.message, reply.line) == (False, "AssertionError",
                                                                  "f doubles", 2)


def test_the_judge_never_unpickles_code(judge, tmp_path):
    """An answer that would run code when unpickled is refused, and the code never runs."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    buf = io.BytesIO()
    torch.save({"mine": Evil()}, buf)
    judge.inputs("t", "x = 1")
    reply = judge.verdict("t", "assert mine['mine'] == 1",
                          {"mine": base64.b64encode(buf.getvalue()).decode()}, [])
    assert reply.error == "NameError" and "not plain data" in reply.message
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):
        loads(buf.getvalue())
    assert dumps(lambda: 1) is None


def test_a_name_the_probe_could_not_send_is_named_in_the_verdict(judge):
    judge.inputs("t", "x = 1")
    reply = judge.verdict("t", "assert mine == 1", {}, ["mine"])
    assert reply.error == "NameError" and "`mine`" in reply.message and "plain data" in reply.message


def test_a_judge_that_does_not_answer_in_time_is_an_error_of_the_grader(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    j = JudgeProcess(env, str(tmp_path), timeout=120)
    try:
        j.setup(["import time"])        # the start (an import of torch) under any load
        j.timeout = 3
        with pytest.raises(JudgeError, match="time limit \\(3 s\\) in slow's inputs"):
            j.inputs("slow", "time.sleep(30)")
        assert j.proc.poll() is not None                    # killed, not left behind
    finally:
        j.close()


# --- tampering --------------------------------------------------------------------

TAMPERING = [
    ("torch.equal = lambda *a, **k: True", "replaces torch.equal"),
    ("torch.testing.assert_close = print", "replaces torch.testing.assert_close"),
    ("del mgpu_lab.scatter", "deletes mgpu_lab.scatter"),
    ("Tensor.add_ = None", "replaces torch.Tensor.add_"),
    ("setattr(torch, 'allclose', min)", "setattr() on torch"),
    ("builtins.print = None", "replaces builtins.print"),
    ("__builtins__.len = None", "touches __builtins__"),
    ("sys.modules['torch'] = None", "touches sys.modules"),
    ("importlib.reload(torch)", "reloads a module"),
    ("get_ipython().set_custom_exc((Exception,), print)", "reaches into IPython"),
    ("get_ipython().showtraceback = print", "reaches into IPython"),
    ("exec('x' + '= 1')", "exec() of a built string"),
    ("eval(code)", "eval() of a built string"),
    ("f = getattr(torch, 'ch' + 'unk')", "getattr() of a computed name on torch"),
    ("frame = sys._getframe(1)", "reads frames"),
    ("g = fn.__globals__", "uses .__globals__"),
    ("import ctypes", "uses ctypes"),
    ("globals()['torch'] = None", "reads globals()"),
    ("vars(torch).update(equal=max)", "takes torch's namespace"),
    ("torch.__dict__['allclose'] = min", "takes torch's namespace"),
    ("ns = vars(mgpu_lab)", "takes mgpu_lab's namespace"),
    ("del vars(torch)['equal']", "takes torch's namespace"),
    ("vars()['torch'] = None", "reads vars()"),
    ("f = vars(torch)['ch' + 'unk']", "takes torch's namespace"),
    ("f = torch.__dict__.get('ch' + 'unk')", "takes torch's namespace"),
    ("with torch.utils._python_dispatch._disable_current_modes(): pass", "sets aside the dispatch modes"),
    ("m = torch.utils._python_dispatch._pop_mode()", "sets aside the dispatch modes"),
    ("with torch.utils._python_dispatch._pop_mode_temporarily(): pass", "sets aside the dispatch modes"),
    ("with torch._C._DisableTorchDispatch(): pass", "sets aside the dispatch modes"),
    ("torch._C._unset_dispatch_mode(k)", "sets aside the dispatch modes"),
    ("m = torch._C._pop_torch_dispatch_stack()", "sets aside the dispatch modes"),
    # attack47: the guard's view of the cells, a second copy of a module, the instruments' state
    ("import linecache; linecache.cache['cell'] = (0, None, ['x'], 'cell')", "touches linecache"),
    ("s = importlib.util.spec_from_file_location('cp', mgpu_lab.__file__)", "second copy of a module"),
    ("torch.utils._python_dispatch._get_current_dispatch_mode_stack()[0].seen['bmm'] += 2",
     "reaches the dispatch modes"),
    ("mgpu_lab.measure.timeline._active[0].spans.append(('R layers.0.attention',))", "private state"),
]
HEADER = "import torch, sys, builtins, importlib, mgpu_lab\nfrom torch import Tensor\n"


@pytest.mark.parametrize("line, what", TAMPERING, ids=[w for _, w in TAMPERING])
def test_each_kind_of_tampering_is_found(line, what):
    found = findings(HEADER + line, {})
    assert any(what in f for f in found), found
    assert found[0].startswith("line 3:"), found


@pytest.mark.parametrize("line", [
    "torch.backends.cudnn.benchmark = True",
    "get_ipython().run_line_magic('matplotlib', 'inline')",
    "%matplotlib inline",
    "exec('x = 1')",
    "net = torch.nn.Linear(2, 2)\nnet.weight = torch.nn.Parameter(torch.zeros(2, 2))",
    "r = object.__new__(object)\nsetattr(r, 'x', 1)",
    "f = getattr(torch, 'zeros')",
    "x = [1]\nx[0] = 2",
    "f = vars(torch)['zeros']\ng = torch.__dict__.get('ones', None)",
    "net = torch.nn.Linear(2, 2)\nstate = vars(net)\nkeys = list(torch.__dict__.keys())",
])
def test_ordinary_code_is_not_tampering(line):
    assert findings(HEADER + line, {}) == []


def _toy(add, mul="def mul(a, b):\n    return a * b", first="import math"):
    sol = nbformat.read(ROOT / "tests" / "data" / "grader" / "solutions" / "toy.ipynb",
                        as_version=4)
    nb = make_lab(sol)
    nb.cells[1].source, nb.cells[2].source, nb.cells[4].source = first, add, mul
    return nb, sol


def test_tampering_costs_the_exercise_it_is_in_or_the_next_one():
    nb, sol = _toy("import torch\ntorch.equal = max\ndef add(a, b):\n    return a + b")
    assert [(w, g) for w, _, g in tampering(nb, sol)] == [("cell 2 (add)", ["add_test"])]
    nb, sol = _toy("def add(a, b):\n    return a + b")
    nb.cells.insert(3, nbformat.v4.new_code_cell("import builtins\nbuiltins.abs = max"))
    assert [(w, g) for w, _, g in tampering(nb, sol)] == [("cell 3", ["mul_test"])]
    nb.cells.append(nbformat.v4.new_code_cell("import builtins\nbuiltins.abs = max"))
    assert [(w, g) for w, _, g in tampering(nb, sol)][-1] == ("cell 8", [])  # marked only


def test_rebinding_a_name_a_probe_uses_or_reading_a_checks_inputs_is_tampering():
    nb, sol = _toy("def add(a, b):\n    return a + b",
                   mul="def mul(p, q):\n    return cases[0][0] * cases[0][1]")
    assert [(w, t, g) for w, t, g in tampering(nb, sol)] == [
        ("cell 4 (mul)", "reads `cases`, a name of a check's inputs, instead of its arguments",
         ["mul_test"])]
    sol = nbformat.read(ROOT / "solutions" / "00_setup.ipynb", as_version=4)
    nb = make_lab(sol)
    nb.cells.insert(3, nbformat.v4.new_code_cell("from mgpu_lab import launch\nimport torch"))
    assert tampering(nb, sol) == []                     # the same imports again are fine
    nb.cells.insert(3, nbformat.v4.new_code_cell("launch = lambda fn, nprocs=2: [0] * nprocs"))
    assert [(w, t, g) for w, t, g in tampering(nb, sol)] == [
        ("cell 3", "line 1: rebinds `launch`, which the checks use",
         ["rank_slice_test", "global_mean_test"])]


def test_the_converted_labs_graded_cells_define_no_function():
    """No `def` in the visible part of a lab's graded cell: a learner could call it
    instead of answering (the probe's launch targets are lambdas)."""
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade") and cell.cell_type == "code":
                assert not any(line.lstrip().startswith(("def ", "async def "))
                               for line in cell.source.splitlines()), \
                    f"{path.name} {meta.get('grade_id')}: defines a callable in a graded cell"


def test_toy_fixture_lab_is_valid():
    check_notebook(nbformat.read(ROOT / "tests" / "data" / "grader" / "solutions" / "toy.ipynb",
                                 as_version=4))
    assert textwrap.dedent(CELL) == CELL


# --- the harms of issue 29 ------------------------------------------------------------

def test_h3_a_check_that_fails_on_the_learners_data_keeps_only_its_type_and_line(judge):
    """Only an assertion keeps its (the instructor's) message: any other exception's text
    may quote the learner's data, which the learner chose."""
    judge.inputs("t", "x = 1")
    reply = judge.verdict("t", "\n\nvalue = int(mine)", {"mine": dumps("secret-input-7")}, [])
    assert (reply.error, reply.message, reply.line) == ("ValueError", "", 3)
    judge.inputs("t", "x = 1")
    reply = judge.verdict("t", "assert mine == 1, 'mine must be 1'", {"mine": dumps(2)}, [])
    assert (reply.error, reply.message) == ("AssertionError", "mine must be 1")


def test_h4_the_judge_refuses_a_view_that_would_make_it_allocate(judge):
    """A zero-stride view (4 bytes of storage, 2**31 elements) sent back as an answer: the
    judge refused to hold it, and copies what it holds."""
    view = torch.zeros(1).expand(2**31)
    judge.inputs("t", "x = 1")
    reply = judge.verdict("t", "assert mine.numel() == 2**31", {"mine": dumps(view)}, [])
    assert reply.error == "NameError" and "not plain data" in reply.message
    judge.inputs("t", "x = 1")
    dense = torch.arange(12.0).reshape(3, 4).t()          # a transposed view: a copy is fine
    assert judge.verdict("t", "assert torch.equal(mine, torch.arange(12.0).reshape(3, 4).t())"
                              " and mine.is_contiguous()", {"mine": dumps(dense)}, []).ok


def test_h4_the_judge_runs_under_a_memory_limit(tmp_path):
    from mgpu_lab.course.grading.judge import MEMORY_ENV
    if list(__import__("glob").glob("/dev/nvidia*")):
        pytest.skip("with a GPU the judge has no address-space limit (CUDA maps far more)")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **{MEMORY_ENV: str(6 * 2**30)})
    j = JudgeProcess(env, str(tmp_path), timeout=120)
    try:
        ship, _ = j.inputs("m", "import resource\nlimit = resource.getrlimit(resource.RLIMIT_DATA)[0]")
        assert loads(ship["limit"]) == 6 * 2**30
    finally:
        j.close()


def test_a_run_keeps_at_most_keep_zygotes_and_a_closed_labs_judges_go_on(tmp_path):
    """A judge pool holds ``keep`` labs' zygotes at most (the least recently used is closed);
    a judge forked before its zygote was closed still answers, and a lab that comes back
    gets a zygote again."""
    from mgpu_lab.course.grading.judge_pool import JudgePool
    from mgpu_lab.course.grading.session import JUDGE_TIMEOUT, judge_environment
    pool = JudgePool(judge_environment, JUDGE_TIMEOUT, keep=2)
    homes = iter(tmp_path / str(i) for i in range(10))

    def judge(lab):
        home = next(homes)
        home.mkdir()
        return pool.judge([f"LAB = {lab}"], str(home))

    try:
        first = judge(1)
        first_zygote = pool.zygotes[("LAB = 1",)]
        judge(2), judge(3)                                   # lab 1's zygote is the oldest: closed
        assert list(pool.zygotes) == [("LAB = 2",), ("LAB = 3",)]
        assert first_zygote.proc.poll() is not None
        first.inputs("t", "x = 1")
        assert first.verdict("t", "assert LAB == 1 and x == 1", {}, []).ok
        again = judge(1)
        again.inputs("t", "x = 2")
        assert again.verdict("t", "assert LAB == 1 and x == 2", {}, []).ok
        assert list(pool.zygotes) == [("LAB = 3",), ("LAB = 1",)]
    finally:
        pool.close()


def test_a_forked_judge_runs_one_thread_whatever_its_zygote_ran(tmp_path):
    """OpenMP cannot run threads in a process forked after its threads ran (lab 01's setup in a
    zygote forked from a kernel without OMP_NUM_THREADS: every lab 01 check hung, JudgeError).
    A forked judge sets torch's threads from its OMP_NUM_THREADS (1) and its matmuls finish."""
    from mgpu_lab.course.grading.judge_pool import JudgePool
    from mgpu_lab.course.grading.session import JUDGE_TIMEOUT, judge_environment
    pool = JudgePool(judge_environment, JUDGE_TIMEOUT, keep=1)
    try:
        j = pool.judge(["import torch\ntorch.set_num_threads(2)\n_ = torch.randn(256, 256) @ torch.randn(256, 256)"],
                       str(tmp_path))
        j.inputs("t", "x = torch.randn(512, 512)")
        assert j.verdict("t", "assert torch.get_num_threads() == 1\nassert (x @ x).shape == (512, 512)", {}, []).ok
    finally:
        pool.close()


def test_rebinding_a_name_a_given_helper_of_the_probe_reads_is_tampering():
    """attack47: lab 15's probe calls the given `run_dispatch`, which reads `MatrixProducts`; a learner's
    stand-in class of that name would report the grouped GEMMs the check looks for."""
    import copy
    import nbformat
    from mgpu_lab.course.grading.tamper import tampering
    from mgpu_lab.course.notebook.cells import nbgrader_meta
    lab = nbformat.read(ROOT / "solutions" / "15_expert_parallel.ipynb", as_version=4)
    assert tampering(lab, lab) == []
    cheat = copy.deepcopy(lab)
    cell = next(c for c in cheat.cells if nbgrader_meta(c).get("solution") and "def ep_dispatch_combine" in c.source)
    cell.source = "class MatrixProducts:\n    pass\n\n" + cell.source
    found = tampering(cheat, lab)
    assert any("rebinds `MatrixProducts`" in what for _, what, _ in found), found
