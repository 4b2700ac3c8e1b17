"""Course commands find the checkout they run in; the wheel ships the labs."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.notebook import layout
from mgpu_lab.course.notebook.layout import copy_labs, find_root
from mgpu_lab.course.notebook.notebooks import lab_id
from conftest import ROOT

TOY = Path(__file__).parent / "data" / "grader" / "solutions" / "toy.ipynb"


def test_find_root_walks_up_from_cwd(tmp_path, monkeypatch):
    (tmp_path / "course" / "solutions").mkdir(parents=True)
    (tmp_path / "course" / "deep" / "er").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "course" / "deep" / "er")
    assert find_root() == tmp_path / "course"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="--root"):
        find_root()


def test_labs_build_from_cwd_writes_the_lab_id(tmp_path, monkeypatch, capsys):
    (tmp_path / "solutions").mkdir()
    shutil.copy(TOY, tmp_path / "solutions" / "03_toy.ipynb")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert cli(["labs", "build", "--check"]) == 1
    assert "03_toy.ipynb (no lab id)" in capsys.readouterr().out
    assert cli(["labs", "build"]) == 0
    for folder in ("labs", "solutions"):
        assert lab_id(nbformat.read(tmp_path / folder / "03_toy.ipynb", as_version=4)) == "03_toy"
    assert cli(["labs", "build", "--check"]) == 0
    monkeypatch.chdir("/")
    assert cli(["labs", "build", "--check", "--root", str(tmp_path)]) == 0
    assert cli(["labs", "build", "--check"]) == 2          # no checkout here: says so
    assert "--root" in capsys.readouterr().err


def test_labs_copy_from_the_checkout_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert cli(["labs", "copy", str(tmp_path / "mine")]) == 0
    names = sorted(p.name for p in (tmp_path / "mine").glob("*.ipynb"))
    assert names == sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))
    (tmp_path / "mine" / "00_setup.ipynb").write_text("my work")
    capsys.readouterr()
    assert cli(["labs", "copy", str(tmp_path / "mine")]) == 0     # nothing new: nothing changes
    assert (tmp_path / "mine" / "00_setup.ipynb").read_text() == "my work"
    assert "kept" in capsys.readouterr().out


def test_labs_copy_adds_the_next_labs_to_a_folder_with_the_learners_work(tmp_path, monkeypatch,
                                                                         capsys):
    """A learner fetches lab 06 into the folder where lab 00 holds their work."""
    monkeypatch.chdir(ROOT)
    mine = tmp_path / "mine"
    assert cli(["labs", "copy", str(mine), "--labs", "00"]) == 0
    assert [p.name for p in mine.glob("*.ipynb")] == ["00_setup.ipynb"]
    (mine / "00_setup.ipynb").write_text("my work")
    assert cli(["labs", "copy", str(mine), "--labs", "00", "06_gradient_accumulation"]) == 0
    assert sorted(p.name for p in mine.glob("*.ipynb")) == ["00_setup.ipynb",
                                                            "06_gradient_accumulation.ipynb"]
    assert (mine / "00_setup.ipynb").read_text() == "my work"
    out = capsys.readouterr().out
    assert "kept" in out and "00_setup.ipynb" in out and "copied 1 lab(s)" in out
    assert cli(["labs", "copy", str(mine), "--labs", "99"]) == 2
    assert "no lab 99" in capsys.readouterr().err


def test_labs_copy_without_a_checkout_uses_the_installed_labs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(layout, "packaged_labs", lambda: ROOT / "labs")
    assert tuple(copy_labs(tmp_path / "learner")) == (
        sorted(p.name for p in (ROOT / "labs").glob("*.ipynb")), [])


def test_wheel_contains_every_package_and_the_labs(tmp_path):
    """`pip wheel` of a copy of the checkout: mgpu_lab/_labs/*.ipynb and every subpackage."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "mgpu_lab", src / "mgpu_lab", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "labs", src / "labs")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("mgpu_lab-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    labs = {f"mgpu_lab/_labs/{p.name}" for p in (ROOT / "labs").glob("*.ipynb")}
    assert labs and labs <= names
    packages = {str(p.relative_to(ROOT)) for p in (ROOT / "mgpu_lab").rglob("__init__.py")}
    assert packages <= names, f"listed in pyproject.toml? {sorted(packages - names)}"
