"""`mgpu-lab tour`: runs solution notebooks from copies and reports each lab."""
import shutil
from pathlib import Path

import nbformat

from mgpu_lab.cli import main as cli
from mgpu_lab.course.notebook.notebooks import graded_cells
from conftest import ROOT

DATA = Path(__file__).parent / "data" / "grader"


def test_tour_lab00_passes_and_leaves_solutions_alone(capsys):
    path = ROOT / "solutions" / "00_setup.ipynb"
    before = path.read_bytes()
    assert cli(["tour", "--only", "00"]) == 0
    out = capsys.readouterr().out
    n = len(graded_cells(nbformat.read(path, as_version=4)))
    assert n >= 1
    row = next(line.split() for line in out.splitlines() if line.startswith("00_setup"))
    assert row[2:] == [f"{n}/{n}", "ok"], out
    assert path.read_bytes() == before


def test_tour_fails_when_a_lab_fails(tmp_path, capsys):
    shutil.copy(DATA / "solutions" / "toy.ipynb", tmp_path / "00_toy.ipynb")
    shutil.copy(DATA / "submissions" / "partial" / "toy.ipynb", tmp_path / "01_partial.ipynb")
    assert cli(["tour", "--solutions", str(tmp_path)]) == 1
    table = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert table["00_toy"][1:] == ["2/2", "ok"]
    assert table["01_partial"][1:] == ["1/2", "FAILED"]
    assert table["01_partial:"][:3] == ["cell", "5:", "NotImplementedError:"]


def test_tour_unknown_lab_is_bad_usage(capsys):
    assert cli(["tour", "--only", "77"]) == 2
    assert "no solution notebook for 77" in capsys.readouterr().err
