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

from .lms import canvas_file, canvas_files, canvas_name, unpack_zip

MAX_DEPTH = 32                    # folders searched below a student's
NAME_LIMIT = 64                   # characters of a name shown as it is
UPLOAD_LIMIT = 256 * 2**20        # bytes unpacked from the zip one student uploaded
MAX_NOTEBOOKS = 32                # notebooks graded per student (the first, by path)


class Submission(NamedTuple):
    student: str
    path: Path
    folder: Optional[str] = None     # the real folder it must be in (None: named by hand)
    uid: Optional[str] = None        # the Canvas user id its file's name carries
    problem: Optional[str] = None    # why it is not graded (not a notebook, too deep)
    subid: Optional[str] = None      # the Canvas id of the file it came as (with uid)
    ambiguous: tuple = ()            # the Canvas names its file's name may be (several)


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


def find_submissions(paths, unpack_to=None, keyed=True) -> List[Submission]:
    """The submissions in ``paths``, each under its student's name (:func:`identify`, no
    roster). A folder holds a folder per student (any depth below it, so nbgrader's
    ``submitted/<student>/<lab>/`` works: pass ``submitted``; no folder name is special)
    and/or flat files (:func:`_flat`: notebooks, whose student is the file stem or the
    name of a Canvas download's ``name_uid_subid_file``, and a Canvas download's other
    files). A zip (a Canvas download as it comes) is read as a flat folder, extracted into
    ``unpack_to``. Notebooks named on the command line in more than one folder
    (``submitted/*/*.ipynb``) are each their folder's student (a Canvas name there is no
    identity, as in a student's folder); all in one folder, flat files. A link to a folder
    at the top is listed, not followed. ``folder``: the real path a found notebook must lie in
    (its student's folder, or the class folder for a flat one): one that a symbolic link
    takes elsewhere is refused when graded. ``keyed=False``: as found, for :func:`identify`
    with a roster (its rows keep their own names)."""
    found, named = [], []
    for p in map(Path, paths):
        if p.is_file() and p.suffix == ".zip":
            if unpack_to is None:
                raise FileNotFoundError(f"{p}: a zip needs a folder to be unpacked into")
            p = unpack_zip(p, Path(unpack_to) / f"{len(found)}-{p.stem}")
        if p.is_dir():
            real = os.path.realpath(p)
            for child in sorted(p.iterdir()):
                if child.is_symlink() and child.is_dir():
                    found.append(Submission(student_name(child.name), child, real,
                                            problem="Link: a link to a folder, not followed"))
                elif child.is_dir() and child.name != ".ipynb_checkpoints":
                    found += handed_in(child, student_name(child.name),
                                       os.path.join(real, child.name))
                elif child.is_file():
                    found += _flat(child, real, unpack_to)
        elif p.is_file():
            named.append(p)
        else:
            raise FileNotFoundError(f"no such notebook or folder: {p}")
    by_folder = len({os.path.realpath(p.parent) for p in named}) > 1
    for p in named:                 # in several folders: each its folder's, as a folder's
        found.append(Submission(student_name(p.parent.name), p) if by_folder
                     else _flat_notebook(p, None))
    return identify(found)[0] if keyed else found


def _flat_notebook(path: Path, real) -> Submission:
    """A flat file's submission: a Canvas name's student and ids when its name splits one
    way only (:func:`~.lms.canvas_files`); else its own name (several splits: ambiguous)."""
    found = canvas_files(path.name)
    canvas = found[0] if len(found) == 1 else None
    if canvas is None:
        return Submission(student_name(path.stem), path, real, ambiguous=tuple(found))
    return Submission(student_name(canvas.name), path, real, canvas.uid, subid=canvas.subid)


def _flat(path: Path, real: str, unpack_to) -> List[Submission]:
    """A file of a class folder: a notebook; or a file of a Canvas download, where what a
    student uploaded is theirs whatever it is: a zip's notebooks (unpacked), or the file
    with its problem ("not a notebook"). Other files are not submissions."""
    if path.name.endswith(".ipynb"):
        return [_flat_notebook(path, real)]
    if not canvas_files(path.name):
        return []
    sub, canvas = _flat_notebook(path, real), canvas_file(path.name)
    student, zipped = sub.student, path.suffix.lower() == ".zip"
    why = "a zip, and no folder to unpack it into" if zipped else "only .ipynb files are graded"
    if zipped and unpack_to is not None:
        try:
            dest = Path(tempfile.mkdtemp(dir=unpack_to, prefix="upload-"))
            unpack_zip(path, dest, path.name[: -len(canvas.file)] if canvas
                       else path.stem + "_", UPLOAD_LIMIT)
            found = [sub._replace(path=nb, folder=os.path.realpath(dest))
                     for nb in sorted(dest.glob("*.ipynb"))]
            if found:
                return found
            why = "a zip with no notebook in it"
        except Exception as err:   # not a zip, too large, unwritable: this upload only
            why = f"a zip that could not be unpacked ({type(err).__name__})"
    return [sub._replace(problem=f"NotANotebook: {why}")]


def identify(found: List[Submission], roster=None) -> Tuple[List[Submission], Dict[str, dict],
                                                          List[str]]:
    """``(submissions, {student: roster row}, notices)``: each submission under one name per
    student. With a ``roster`` (:class:`~.lms.Roster`), a student is the row a submission
    matches (:meth:`~.lms.Roster.match`); one that matches no row, or several, keeps its
    own name, is in no row, and is named in the notices. Without one (and for those), a
    student is a Canvas user id or, without an id, a name. A student's name is the first
    of its submissions' names; a name two students share gets ``_`` and an id (the Canvas
    user id, the row's ID; a folder's name: ``_``) on all but one: a roster row's, else the
    one of that exact name. A file whose Canvas name splits several ways is the roster's
    row whose ``Student``, written as Canvas writes it (:func:`~.lms.canvas_name`), is the
    name of exactly one split; else it is graded under its own name, in no row. A
    student's notebooks past :data:`MAX_NOTEBOOKS` are listed, not graded."""
    whom, whys, found = [], [], [_resolve(sub, roster) for sub in found]
    for sub in found:
        row, why = (roster.match(sub.student, sub.uid) if roster and not sub.ambiguous
                    else (None, ""))
        whom.append(("row", row) if row is not None else ("uid", sub.uid) if sub.uid
                    else ("name", sub.student))
        whys.append(why)
    name: Dict[tuple, str] = {}
    for sub, w in zip(found, whom):
        name[w] = min(name.get(w, sub.student), sub.student)
    taken, shared, key = set(name.values()), {}, {}
    for w, n in name.items():
        shared.setdefault(n, []).append(w)
    for w, n in name.items():
        key[w], rows = n, [x for x in shared[n] if x[0] == "row"]
        keeper = rows[0] if len(rows) == 1 else ("name", n)   # a row keeps its own name
        if len(shared[n]) > 1 and w != keeper:
            key[w] = f"{n}_{_id(w, roster)}" if w[0] != "name" else f"{n}_"
            while key[w] in taken:
                key[w] += "_"
            taken.add(key[w])
    rows, notices = {key[w]: roster.rows[w[1]] for w in name if w[0] == "row"}, []
    for sub, w, why in zip(found, whom, whys):
        notice = f"not in the roster: {key[w]}: {why}; graded under its own name, in no row"
        if sub.ambiguous:
            ids = " or ".join(c.uid for c in sub.ambiguous)
            notice = (f"ambiguous Canvas name: {key[w]}: the user id in its file's name "
                      f"may be {ids}; graded under its own name, in no row")
        if (why or sub.ambiguous) and notice not in notices:
            notices.append(notice)
    return _capped([sub._replace(student=key[w]) for sub, w in zip(found, whom)]), rows, notices


def _resolve(sub: Submission, roster) -> Submission:
    """An ambiguous Canvas name's one split whose user id is a roster row's ``ID`` and whose
    name is that row's ``Student`` as Canvas writes it; else ``sub`` as it is."""
    from .lms import value
    if not sub.ambiguous or roster is None:
        return sub
    hits = [c for c in sub.ambiguous for row in roster.rows
            if (value(row, "ID") or "").strip() == c.uid
            and canvas_name(value(row, "Student") or "") == c.name]
    if len(hits) != 1:
        return sub
    return sub._replace(student=student_name(hits[0].name), uid=hits[0].uid,
                        subid=hits[0].subid, ambiguous=())


def _capped(subs: List[Submission]) -> List[Submission]:
    """``subs`` with each student's notebooks past the first :data:`MAX_NOTEBOOKS` (by path)
    left out, and said so once per student."""
    paths: Dict[str, list] = {}
    for sub in subs:
        if sub.problem is None:
            paths.setdefault(sub.student, []).append(sub.path)
    over = {s: sorted(p)[MAX_NOTEBOOKS:] for s, p in paths.items() if len(p) > MAX_NOTEBOOKS}
    left = {(s, p) for s, rest in over.items() for p in rest}
    kept = [sub for sub in subs if (sub.student, sub.path) not in left or sub.problem]
    return kept + [Submission(s, rest[0], problem=f"TooMany: more than {MAX_NOTEBOOKS} "
                              f"notebooks: graded the first {MAX_NOTEBOOKS} by name; this one "
                              f"and {len(rest) - 1} more not graded")
                   for s, rest in over.items()]


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
