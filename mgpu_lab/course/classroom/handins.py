"""Who handed in what: a class's folder (or a Canvas download) as a list of submissions.

Used by ``mgpu-lab grade`` (:mod:`.grade`) and the platforms' graders
(:mod:`.platforms`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, NamedTuple, Optional

from .lms import canvas_file, unpack_zip


class Submission(NamedTuple):
    student: str
    path: Path
    folder: Optional[str] = None     # the real folder it must be in (None: named by hand)


def notebooks_in(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts and p.is_file())


def find_submissions(paths, unpack_to=None) -> List[Submission]:
    """``[(student, notebook, folder)]``. A folder holds a folder per student (any depth
    below it, so nbgrader's ``submitted/<student>/<lab>/`` works: pass ``submitted``)
    and/or flat notebooks (student = file stem, or the name of a Canvas download's
    ``name_uid_subid_file``). A zip (a Canvas download as it comes) is read as a flat
    folder, extracted into ``unpack_to``. Notebooks named on the command line are students
    of their own names, or of their folders' names when each is in a folder of its own
    (``submitted/*/lab.ipynb``). ``folder``: the real path a found notebook must lie in (its
    student's folder, or the class folder for a flat one): one that a symbolic link takes
    elsewhere is refused when graded."""
    found, named = [], []
    for p in map(Path, paths):
        if p.is_file() and p.suffix == ".zip":
            if unpack_to is None:
                raise FileNotFoundError(f"{p}: a zip needs a folder to be unpacked into")
            p = unpack_zip(p, Path(unpack_to) / f"{len(found)}-{p.stem}")
        if p.is_dir():
            if (p / "submitted").is_dir():
                p = p / "submitted"
            real = os.path.realpath(p)
            for child in sorted(p.iterdir()):
                if child.is_dir() and child.name != ".ipynb_checkpoints":
                    own = os.path.join(real, child.name)
                    found += [Submission(child.name, nb, own) for nb in notebooks_in(child)]
                elif child.suffix == ".ipynb" and child.is_file():
                    found.append(Submission(_flat_student(child), child, real))
        elif p.is_file():
            named.append(p)
        else:
            raise FileNotFoundError(f"no such notebook or folder: {p}")
    folders = [os.path.realpath(p.parent) for p in named]
    by_folder = len(named) > 1 and len(set(folders)) == len(folders)
    found += [Submission(p.parent.name if by_folder and not canvas_file(p.name)
                         else _flat_student(p), p) for p in named]
    return _distinct_canvas_names(found)


def _flat_student(path: Path) -> str:
    canvas = canvas_file(path.name)
    return canvas.name if canvas else path.stem


def _distinct_canvas_names(found: List[Submission]) -> List[Submission]:
    """Two Canvas students who share a name (two Jane Does) become ``name_uid``."""
    uids: dict = {}
    for sub in found:
        canvas = canvas_file(sub.path.name)
        if canvas and sub.student == canvas.name:
            uids.setdefault(canvas.name, set()).add(canvas.uid)
    shared = {name for name, ids in uids.items() if len(ids) > 1}
    return [sub._replace(student=f"{sub.student}_{canvas_file(sub.path.name).uid}")
            if sub.student in shared and canvas_file(sub.path.name) else sub for sub in found]


def only_labs(submissions, labs, wanted) -> tuple:
    """``(submissions, labs)`` kept for ``--lab``: the labs asked for (a number or an id)
    and the notebooks that match one of them (or no lab at all: those get their line)."""
    import nbformat
    from ..grading.grader import NOTEBOOK_LIMIT, match_lab
    from ..notebook.layout import select_labs
    keep = {name[:-6] for name in select_labs([f"{lab}.ipynb" for lab in labs], wanted)}
    kept = []
    for sub in submissions:
        try:
            if os.path.getsize(sub.path) > NOTEBOOK_LIMIT:
                raise ValueError("too large")
            lab, _ = match_lab(nbformat.read(sub.path, as_version=4), labs)
        except Exception:
            lab = None                        # unreadable: graded, to say so
        if lab is None or lab in keep:
            kept.append(sub)
    return kept, {lab: nb for lab, nb in labs.items() if lab in keep}
