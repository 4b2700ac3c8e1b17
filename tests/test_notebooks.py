"""labs/ generated from solutions/: markers, metadata, freshness, execution, sanitizing."""
import ast
import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from mgpu_lab.course.notebook import notebooks
from mgpu_lab.course.notebook.cells import DEMO_TAG, nbgrader_meta, tags
from mgpu_lab.cli import main as cli
from mgpu_lab.course.notebook.notebooks import MarkerError, build_labs, graded_cells, make_lab, strip_solution
from conftest import ROOT

DATA = Path(__file__).parent / "data" / "grader"
TOY = DATA / "solutions" / "toy.ipynb"


def test_labs_are_fresh(capsys):
    """labs/ must be what `mgpu-lab labs build` makes from solutions/ today."""
    code = cli(["labs", "build", "--check"])
    out = capsys.readouterr()
    assert code == 0, "labs/ is stale; run `mgpu-lab labs build`:\n" + out.out + out.err
    assert sorted(p.name for p in (ROOT / "labs").glob("*.ipynb")) == \
        sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))


def test_solution_region_becomes_stub_at_its_indentation():
    source = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    if x:\n        return x + y\n"
              "    return y\n    ### END SOLUTION\n\nprint('kept')")
    assert strip_solution(source) == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n"
                                      "    raise NotImplementedError()\n\nprint('kept')")
    top = "### BEGIN SOLUTION\nx = 1\n### END SOLUTION"
    assert strip_solution(top) == "# YOUR CODE HERE\nraise NotImplementedError()"
    assert strip_solution("Answer:\n### BEGIN SOLUTION\n42\n### END SOLUTION", "markdown") == \
        "Answer:\nYOUR ANSWER HERE"


def test_hidden_tests_are_removed():
    source = ("assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(2) == 3\n"
              "### END HIDDEN TESTS\nprint('ok')")
    assert strip_solution(source) == "assert f(1) == 2\nprint('ok')"


@pytest.mark.parametrize("source, words", [
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx\n### END SOLUTION\n### END SOLUTION", "nested"),
    ("x = 1\n### BEGIN SOLUTION\nx = 2", "line 2.*never closed"),
    ("x = 1\n### END SOLUTION", "without"),
    ("### BEGIN HIDDEN TESTS\nassert 1", "never closed"),
])
def test_bad_markers_are_errors(source, words):
    with pytest.raises(MarkerError, match=words):
        strip_solution(source)


def _toy():
    return nbformat.read(TOY, as_version=4)


def test_make_lab_clears_outputs_keeps_metadata_and_locks_tests():
    solution = _toy()
    solution.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="ok\n")]
    solution.cells[3].execution_count = 4
    before = json.dumps(solution, sort_keys=True)
    lab = make_lab(solution)
    assert json.dumps(solution, sort_keys=True) == before, "make_lab must not change its input"
    assert len(lab.cells) == len(solution.cells)
    for s, l in zip(solution.cells, lab.cells):
        assert l.metadata.get("nbgrader") == s.metadata.get("nbgrader")
        if l.cell_type == "code":
            assert l.outputs == [] and l.execution_count is None
    text = nbformat.writes(lab)
    assert "return a + b" not in text and "assert mul(-1, 4)" not in text
    assert "raise NotImplementedError()" in lab.cells[2].source
    graded = [c for c in lab.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) == 2
    assert all(c.metadata["editable"] is False and c.metadata["deletable"] is False for c in graded)
    assert "editable" not in lab.cells[2].metadata  # the exercise stays editable


@pytest.mark.parametrize("change, words", [
    (lambda nb: nb.cells[2].metadata.pop("nbgrader"), "without nbgrader metadata"),
    (lambda nb: nb.cells[4].metadata["nbgrader"].update(grade_id="add"), "used twice"),
    (lambda nb: nb.cells[3].metadata["nbgrader"].pop("points"), "numeric 'points'"),
    (lambda nb: nb.cells.__setitem__(1, nbformat.v4.new_code_cell(
        "### BEGIN HIDDEN TESTS\nassert 1\n### END HIDDEN TESTS")), "not graded"),
])
def test_metadata_mistakes_are_errors(change, words):
    nb = _toy()
    change(nb)
    with pytest.raises(MarkerError, match=words):
        make_lab(nb)


def test_build_check_detects_stale_missing_and_orphan_labs(tmp_path, capsys):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    shutil.copy(TOY, solutions / "01_toy.ipynb")
    args = ["labs", "build", "--solutions", str(solutions), "--labs", str(labs)]
    assert cli(args + ["--check"]) == 1                 # missing
    assert "missing" in capsys.readouterr().out
    assert cli(args) == 0 and (labs / "01_toy.ipynb").exists()
    assert cli(args + ["--check"]) == 0
    nb = nbformat.read(solutions / "01_toy.ipynb", as_version=4)
    nb.cells[0].source += "\nOne more line."
    nbformat.write(nb, solutions / "01_toy.ipynb")
    (labs / "99_orphan.ipynb").write_text("{}")
    capsys.readouterr()
    assert cli(args + ["--check"]) == 1
    out = capsys.readouterr().out
    assert "01_toy.ipynb (stale)" in out and "99_orphan.ipynb (no solution" in out
    assert build_labs(solutions, labs) and not (labs / "99_orphan.ipynb").exists()
    assert "One more line." in (labs / "01_toy.ipynb").read_text()
    assert build_labs(solutions, labs, check=True) == []


def test_build_reports_bad_markers_as_usage_error(tmp_path, capsys):
    nb = _toy()
    nb.cells[2].source = nb.cells[2].source.replace("### END SOLUTION", "")
    (tmp_path / "s").mkdir()
    nbformat.write(nb, tmp_path / "s" / "toy.ipynb")
    assert cli(["labs", "build", "--solutions", str(tmp_path / "s"),
                "--labs", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err
    assert "toy.ipynb" in err and "cell 2" in err and "never closed" in err


def test_execute_stores_outputs_without_temp_paths(tmp_path):
    nb = _toy()
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        "import warnings\nwarnings.warn('careful')\nprint(6 * 7)"))
    path = tmp_path / "toy.ipynb"
    nbformat.write(nb, path)
    assert cli(["labs", "execute", str(path)]) == 0
    done = nbformat.read(path, as_version=4)
    code = [c for c in done.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    texts = {o.name: o.text for o in code[0].outputs}
    assert texts["stdout"] == "42\n"
    assert "UserWarning: careful" in texts["stderr"] and texts["stderr"].startswith("<cell>:2:")
    assert "ipykernel_" not in path.read_text()
    assert "mul passed" in path.read_text()
    assert "language_info" in done.metadata


def test_execute_fails_on_an_error(tmp_path, capsys):
    nb = _toy()
    nb.cells[4].source = nb.cells[4].source.replace("a * b", "a + b")
    nbformat.write(nb, tmp_path / "toy.ipynb")
    assert cli(["labs", "execute", str(tmp_path / "toy.ipynb")]) == 1
    assert "AssertionError" in capsys.readouterr().err
    assert cli(["labs", "execute", str(tmp_path / "nope.ipynb")]) == 2


def _sanitize(text):
    from nbval.plugin import get_sanitize_patterns
    patterns = get_sanitize_patterns((ROOT / "solutions" / "sanitize.cfg").read_text())
    assert len(patterns) >= 8
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("a, b", [
    ("/tmp/ipykernel_4242/3141592653.py:3: UserWarning: x", "<cell>:3: UserWarning: x"),
    ("step took 0.53 s, 12.5ms per batch", "step took 1.20 s, 9.1ms per batch"),
    ("NVIDIA H100 80GB HBM3, bf16", "Tesla T4, bf16"),
    ("object at 0x7f3a12bc4560", "object at 0x55d0aa01be10"),
    ("store on localhost:29500", "store on localhost:41234"),
    ("1234.5 samples/s", "998.0 samples/s"),
])
def test_sanitize_cfg_hides_what_varies(a, b):
    assert _sanitize(a) == _sanitize(b)


@pytest.mark.parametrize("a, b", [
    ("loss 0.1234 at step 10", "loss 0.1235 at step 10"),
    ("[rank 0] 4 rows", "[rank 1] 4 rows"),
    ("rank_slice passed", "rank_slice failed"),
    ("grad norm 3.5000", "grad norm 3.5001"),
])
def test_sanitize_cfg_keeps_what_is_checked(a, b):
    assert _sanitize(a) == a and _sanitize(a) != _sanitize(b)


def test_kernel_path_regex_matches_the_sanitize_cfg():
    assert notebooks.KERNEL_PATH.pattern in (ROOT / "solutions" / "sanitize.cfg").read_text()


def test_answer_key_cells_stay_in_the_solution():
    solution = _toy()
    key = nbformat.v4.new_markdown_cell("**Answers.** 1. Because the ring sends 2(N-1)/N of the data.")
    key.metadata["tags"] = ["answer-key"]
    solution.cells.append(key)
    lab = make_lab(solution)
    assert len(lab.cells) == len(solution.cells) - 1
    assert "Answers." not in nbformat.writes(lab)


def test_readme_lab_table_matches_the_notebooks():
    """README's "The labs" table: one row per solution, with its exercises and points."""
    import re
    from mgpu_lab.course.notebook.cells import exercise_of
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d\d) \|.*?\| (\d+ \(\d+\)) \|", readme, re.M))
    want = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        tests = graded_cells(nb)
        exercises = set(exercise_of(nb).values())
        points = sum(c.metadata["nbgrader"]["points"] for c in tests.values())
        want[path.stem[:2]] = f"{len(exercises)} ({points:g})"
    assert rows == want, f"README says {rows}, the notebooks have {want}"


def test_instructors_honour_level_table_lists_every_check_that_observes_the_kernel():
    """docs/INSTRUCTORS.md's honour-level table: one row per graded cell with ``observed`` metadata
    (lab and points), and the total it states."""
    from mgpu_lab.course.notebook.cells import observed_of
    guide = (ROOT / "docs" / "INSTRUCTORS.md").read_text()
    table = guide[guide.index("| lab, exercise | points | observed in the kernel"):]
    table = table[:table.index("\n\n")]
    rows = sorted((lab, int(points)) for lab, points in re.findall(r"^  \| (\d\d) [^|]*\| (\d+) \|", table, re.M))
    want, total = [], 0
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in graded_cells(nbformat.read(path, as_version=4)).values():
            total += cell.metadata["nbgrader"]["points"]
            if observed_of(cell):
                want.append((path.stem[:2], cell.metadata["nbgrader"]["points"]))
    assert rows == sorted(want), \
        f"docs/INSTRUCTORS.md's honour-level rows {rows}, the notebooks' observed cells {sorted(want)}"
    honour = sum(p for _, p in want)
    assert f"These cells hold {honour} of the course's {total:g}" in guide.replace("\n  ", " "), \
        f"docs/INSTRUCTORS.md should say: These cells hold {honour} of the course's {total:g} points"


def _resolves(dotted: str) -> bool:
    import importlib
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_reimplemented_reference_names_an_object():
    """A dotted ``reimplements`` name that names nothing guards nothing at run time (a teaching tool moved out
    of the top level is named by its module: ``mgpu_lab.parallel.zero.partition_parameters``). A name without
    a dot is one of the notebook's own functions (lab 09's ``mgpu_loop``), checked statically."""
    missing = []
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for name in (cell.metadata.get("mgpu_lab") or {}).get("reimplements") or []:
                if "." in name and not _resolves(name):
                    missing.append(f"{path.stem}: {name}")
    assert not missing, missing


PLOTTING = {"matplotlib", "ipywidgets", "tqdm"}


def test_cells_the_grader_runs_import_no_plotting_or_widget_library():
    """Matplotlib, ipywidgets and tqdm belong in demo cells: every graded notebook's kernel
    (and each lab's judge, which runs the setup cells) would import them for nothing
    (about 0.6 s of CPU per notebook; docs/AUTHORING.md)."""
    found = []
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "code" or (DEMO_TAG in tags(cell) and not nbgrader_meta(cell)):
                continue                                    # the grader's rule (submission.py)
            lines = cell.source.split("\n")
            found += [f"{path.name} cell {index}: {line}" for line in lines if line.startswith("%matplotlib")]
            tree = ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.name} cell {index}: imports {n}" for n in names if n.split(".")[0] in PLOTTING]
    assert not found, "\n".join(found)
