"""Releasing labs and the author's loop: ``labs copy --update`` replaces a copy made from an
older version of a changed lab (the learner's file kept as ``NAME.ipynb.bak``, and said so),
never the learner's work on the current version; ``labs check`` fails on a stale README lab
table, as CI does."""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from mgpu_lab.cli import main as cli
from mgpu_lab.course.authoring import labs_command
from mgpu_lab.course.notebook.notebooks import build_labs

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "data" / "grader" / "solutions" / "toy.ipynb"
LAB = "06_toy.ipynb"


def release(root: Path, version: str, text: str = "# Lab 06") -> Path:
    """A checkout whose ``labs/06_toy.ipynb`` records lab version ``version``."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])
    nb.metadata["mgpu_lab"] = {"lab": "06_toy", "version": version}
    (root / "labs").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, root / "labs" / LAB)
    return root


def learner_edits(path: Path, text: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(text))
    nbformat.write(nb, path)


def test_copy_update_replaces_an_older_version_and_keeps_the_learners_file(tmp_path, capsys):
    mine, old, new = tmp_path / "mine", tmp_path / "v1", tmp_path / "v2"
    release(old, "aaaaaaaaaaaa")
    release(new, "bbbbbbbbbbbb", "# Lab 06, fixed")
    assert cli(["labs", "copy", str(mine), "--root", str(old)]) == 0
    learner_edits(mine / LAB, "x = 'my answer'")
    capsys.readouterr()
    # Without --update: kept, and said why and how to take the new version.
    assert cli(["labs", "copy", str(mine), "--root", str(new)]) == 0
    out = capsys.readouterr().out
    assert "older version" in out and "aaaaaaaaaaaa -> bbbbbbbbbbbb" in out and "--update" in out
    assert "my answer" in (mine / LAB).read_text()
    # --update: the release replaces it, the learner's file is NAME.ipynb.bak, and it says so.
    assert cli(["labs", "copy", str(mine), "--root", str(new), "--update"]) == 0
    out = capsys.readouterr().out
    assert f"replaced {mine / LAB}" in out and f"{LAB}.bak" in out
    assert (mine / LAB).read_bytes() == (new / "labs" / LAB).read_bytes()
    assert "my answer" in (mine / f"{LAB}.bak").read_text()
    assert sorted(p.name for p in mine.iterdir()) == [LAB, f"{LAB}.bak"]   # one notebook
    # Again: nothing left to replace; a second replacement never overwrites a backup.
    assert cli(["labs", "copy", str(mine), "--root", str(new), "--update"]) == 0
    assert "replaced" not in capsys.readouterr().out
    shutil.copy(mine / f"{LAB}.bak", mine / LAB)
    assert cli(["labs", "copy", str(mine), "--root", str(new), "--update"]) == 0
    assert (mine / f"{LAB}.bak2").exists() and "my answer" in (mine / f"{LAB}.bak").read_text()


def test_copy_update_never_replaces_work_on_the_current_version(tmp_path, capsys):
    mine, root = tmp_path / "mine", release(tmp_path / "v1", "aaaaaaaaaaaa")
    assert cli(["labs", "copy", str(mine), "--root", str(root)]) == 0
    learner_edits(mine / LAB, "x = 'my answer'")
    capsys.readouterr()
    assert cli(["labs", "copy", str(mine), "--root", str(root), "--update"]) == 0
    assert "my answer" in (mine / LAB).read_text()
    assert "your work on this version" in capsys.readouterr().out
    assert not list(mine.glob("*.bak*"))


def _checkout(tmp: Path, readme_row: str) -> Path:
    """A course checkout with one lab (the toy: 2 exercises, 5 points) and CI's tests."""
    root = tmp / "course"
    (root / "solutions").mkdir(parents=True)
    shutil.copy(TOY, root / "solutions" / "00_toy.ipynb")
    build_labs(root / "solutions", root / "labs")
    (root / "tests").mkdir()
    for name in ("conftest.py", "test_notebooks.py"):
        shutil.copy(ROOT / "tests" / name, root / "tests" / name)
    (root / "tests" / "test_mutants.py").write_text("")
    (root / "README.md").write_text(f"## The labs\n\n| lab | topic | exercises (points) |\n"
                                    f"|---|---|---|\n{readme_row}\n")
    return root


def test_labs_check_fails_on_a_stale_readme_lab_table(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(labs_command, "check_command",       # the nbval and mutation run
                        lambda root, lab: ran.append(lab) or [sys.executable, "-c", "pass"])
    stale = _checkout(tmp_path / "stale", "| 00 | toy | 3 (11) |")
    assert cli(["labs", "check", "00", "--root", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "README.md's lab table is stale" in err and "'00': '2 (5)'" in err
    assert ran == []                                        # it stops there
    fresh = _checkout(tmp_path / "fresh", "| 00 | toy | 2 (5) |")
    assert cli(["labs", "check", "00", "--root", str(fresh)]) == 0
    assert ran == ["00_toy"]


def test_labs_check_says_when_it_cannot_check_the_readme_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(labs_command, "check_command",
                        lambda root, lab: [sys.executable, "-c", "pass"])
    root = _checkout(tmp_path, "| 00 | toy | 3 (11) |")
    (root / "tests" / "test_notebooks.py").unlink()
    assert cli(["labs", "check", "00", "--root", str(root)]) == 0
    assert "README's lab table not checked: no tests/test_notebooks.py" in capsys.readouterr().err
