"""Who handed in what: a class's folder (or a Canvas download) as a list of submissions,
each under the one name of the student it is (:func:`identify`).

Used by ``mgpu-lab grade`` (:mod:`.grade`) and the platforms' graders
(:mod:`.platforms`). How a submission is stored costs that submission only: a name in
any bytes (:func:`student_name`), any depth (:data:`MAX_DEPTH`), a zip a student
uploaded (unpacked), a file that is not a notebook (listed, with its ``problem``).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from .lms import canvas_file, unpack_zip

MAX_DEPTH = 32                    # folders searched below a student's
NAME_LIMIT = 64                   # characters of a name shown as it is
UPLOAD_LIMIT = 256 * 2**20        # bytes unpacked from the zip one student uploaded


class Submission(NamedTuple):
    student: str
    path: Path
    folder: Optional[str] = None     # the real folder it must be in (None: named by hand)
    uid: Optional[str] = None        # the Canvas user id its file's name carries
    problem: Optional[str] = None    # why it is not graded (not a notebook, too deep)


def student_name(raw) -> str:
    """The student a folder's or file's name (``str`` or ``bytes``, any bytes) names: the name
    itself when it is printable UTF-8, without ``~``, of :data:`NAME_LIMIT` characters at
    most; else its printable part, cut, then ``~`` and a hash of its bytes. Distinct
    names stay distinct; no control character or unbounded name reaches a report."""
    data = os.fsencode(raw)
    text = data.decode("utf-8", "replace")
    if (text.isprintable() and len(text) <= NAME_LIMIT and "~" not in text
            and "\ufffd" not in text and text.strip() == text and text):
        return text
    shown = "".join(c if c.isprintable() and c not in "~\ufffd" else "?" for c in text)
    return f"{shown[:40]}~{hashlib.sha256(data).hexdigest()[:12]}"


def handed_in(folder: Path, student: str, real: Optional[str] = None) -> List[Submission]:
    """The notebooks in ``folder`` (one student's), :data:`MAX_DEPTH` folders down at most
    (a deeper folder is a :class:`Submission` with its problem); not in checkpoints, no
    symbolic link to a folder followed. ``real``: the real folder they must lie in."""
    real = real or os.path.realpath(folder)
    found, deep, todo = [], [], [(Path(folder), 0)]
    while todo:
        here, depth = todo.pop()
        try:
            with os.scandir(here) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError as err:
            found.append(Submission(student, here, real, problem=f"Unreadable: a folder "
                                    f"({err.strerror})"))
            continue
        for entry in entries:
            path = here / entry.name
            if entry.is_dir(follow_symlinks=False):
                if entry.name == ".ipynb_checkpoints":
                    continue
                if depth < MAX_DEPTH:
                    todo.append((path, depth + 1))
                elif not deep:        # one is enough to say so
                    deep.append(Submission(student, path, real, problem=f"TooDeep: a folder "
                                           f"more than {MAX_DEPTH} levels down, not searched"))
            elif entry.name.endswith(".ipynb") and entry.is_file():
                found.append(Submission(student, path, real))
    return sorted(found, key=lambda s: s.path) + deep


def find_submissions(paths, unpack_to=None) -> List[Submission]:
    """The submissions in ``paths``, each under its student's name (:func:`identify`, no
    roster). A folder holds a folder per student (any depth below it, so nbgrader's
    ``submitted/<student>/<lab>/`` works: pass ``submitted``; no folder name is special)
    and/or flat files (:func:`_flat`: notebooks, whose student is the file stem or the
    name of a Canvas download's ``name_uid_subid_file``, and a Canvas download's other
    files). A zip (a Canvas download as it comes) is read as a flat folder, extracted into
    ``unpack_to``. Notebooks named on the command line are students of their own names,
    or of their folders' names when each is in a folder of its own
    (``submitted/*/lab.ipynb``). ``folder``: the real path a found notebook must lie in
    (its student's folder, or the class folder for a flat one): one that a symbolic link
    takes elsewhere is refused when graded."""
    found, named = [], []
    for p in map(Path, paths):
        if p.is_file() and p.suffix == ".zip":
            if unpack_to is None:
                raise FileNotFoundError(f"{p}: a zip needs a folder to be unpacked into")
            p = unpack_zip(p, Path(unpack_to) / f"{len(found)}-{p.stem}")
        if p.is_dir():
            real = os.path.realpath(p)
            for child in sorted(p.iterdir()):
                if child.is_dir() and child.name != ".ipynb_checkpoints":
                    found += handed_in(child, student_name(child.name),
                                       os.path.join(real, child.name))
                elif child.is_file():
                    found += _flat(child, real, unpack_to)
        elif p.is_file():
            named.append(p)
        else:
            raise FileNotFoundError(f"no such notebook or folder: {p}")
    folders = [os.path.realpath(p.parent) for p in named]
    by_folder = len(named) > 1 and len(set(folders)) == len(folders)
    for p in named:
        canvas = canvas_file(p.name)
        found.append(Submission(student_name(p.parent.name), p) if by_folder and not canvas
                     else Submission(_flat_student(p), p, uid=canvas and canvas.uid))
    return identify(found)[0]


def _flat_student(path: Path) -> str:
    canvas = canvas_file(path.name)
    return student_name(canvas.name if canvas else path.stem)


def _flat(path: Path, real: str, unpack_to) -> List[Submission]:
    """A file of a class folder: a notebook; or a file of a Canvas download, where what a
    student uploaded is theirs whatever it is: a zip's notebooks (unpacked), or the file
    with its problem ("not a notebook"). Other files are not submissions."""
    canvas = canvas_file(path.name)
    uid = canvas and canvas.uid
    if path.suffix == ".ipynb":
        return [Submission(_flat_student(path), path, real, uid)]
    if canvas is None:
        return []
    student, zipped = student_name(canvas.name), path.suffix.lower() == ".zip"
    why = "a zip, and no folder to unpack it into" if zipped else "only .ipynb files are graded"
    if zipped and unpack_to is not None:
        try:
            dest = Path(tempfile.mkdtemp(dir=unpack_to, prefix="upload-"))
            unpack_zip(path, dest, path.name[: -len(canvas.file)], UPLOAD_LIMIT)
            found = [Submission(student, nb, os.path.realpath(dest), uid)
                     for nb in sorted(dest.glob("*.ipynb"))]
            if found:
                return found
            why = "a zip with no notebook in it"
        except Exception as err:   # not a zip, too large, unwritable: this upload only
            why = f"a zip that could not be unpacked ({type(err).__name__})"
    return [Submission(student, path, real, uid, f"NotANotebook: {why}")]


def identify(found: List[Submission], roster=None) -> Tuple[List[Submission], Dict[str, dict],
                                                          List[str]]:
    """``(submissions, {student: roster row}, notices)``: each submission under one name per
    student. With a ``roster`` (:class:`~.lms.Roster`), a student is the row a submission
    matches (:meth:`~.lms.Roster.match`); one that matches no row, or several, keeps its
    own name, is in no row, and is named in the notices. Without one (and for those), a
    student is a Canvas user id or, without an id, a name. A student's name is the first
    of its submissions' names; a name two students share gets ``_`` and an id (the Canvas
    user id, the row's ID) on all but the one of that exact name."""
    whom, notices = [], []
    for sub in found:
        row, why = roster.match(sub.student, sub.uid) if roster else (None, "")
        whom.append(("row", row) if row is not None else ("uid", sub.uid) if sub.uid
                    else ("name", sub.student))
        notice = f"not in the roster: {sub.student}: {why}; graded under its own name, in no row"
        if why and notice not in notices:
            notices.append(notice)
    name: Dict[tuple, str] = {}
    for sub, w in zip(found, whom):
        name[w] = min(name.get(w, sub.student), sub.student)
    taken, shared, key = set(name.values()), {}, {}
    for w, n in name.items():
        shared.setdefault(n, []).append(w)
    for w, n in name.items():
        key[w] = n
        if len(shared[n]) > 1 and w[0] != "name":
            key[w] = f"{n}_{_id(w, roster)}"
            while key[w] in taken:
                key[w] += "_"
            taken.add(key[w])
    rows = {key[w]: roster.rows[w[1]] for w in name if w[0] == "row"}
    return [sub._replace(student=key[w]) for sub, w in zip(found, whom)], rows, notices


def _id(whom: tuple, roster) -> str:
    if whom[0] == "uid":
        return whom[1]
    from .lms import value
    row = roster.rows[whom[1]]
    return student_name((value(row, "ID") or value(row, "SIS Login ID") or str(whom[1]))[:20])


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
