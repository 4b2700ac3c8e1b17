"""Gradebooks of learning-management systems: Canvas in and out, a roster, nbgrader.

- **A Canvas submissions download as it comes**: the zip (or its unzipped folder) of
  files named ``name_uid_attid_file`` (``name_LATE_uid_attid_file`` when late;
  ``lab-1.ipynb`` when re-uploaded): :func:`canvas_files` reads such a name (every split:
  a name can end in digits): the student is ``name`` (``name_uid`` where two students
  share a name), ``uid`` is the Canvas user id that a roster matches, ``attid`` the id of
  the submission's file (Canvas's ``ContentZipper``). :mod:`.handins` reads them once, for
  a download's flat file only; the exports below use what it decided. :func:`unpack_zip`
  extracts a download's files (a zip a student uploaded is unpacked by :mod:`.handins`).
  A download holds each student's latest submission only, and its files' times are when
  Canvas made the zip, not when they were handed in.
- **A roster** (``--roster roster.csv``, :func:`read_roster`): Canvas's gradebook export
  as it comes, or any CSV with a header. A submission is a row's (:meth:`Roster.match`)
  by its Canvas user id, else by a login (:data:`LOGINS`), else by a display name that
  exactly one row has; never by a name two rows share. Its "Points Possible" row is kept
  (:attr:`Roster.points`).
- **Canvas's import CSV** (:func:`write_canvas_csv`): Canvas's identity columns
  (:data:`CANVAS_IDENTITY`, from the roster), one column per lab: the roster's column
  whose title names the lab (:func:`names_lab`: "Lab 6: ...", "Lab-06", "6. ...", or the
  lab id), or the one ``--assignment 06=ID|TITLE`` names (:func:`canvas_columns`); two
  candidates are an error, and a lab with none is left out (Canvas would make a new
  assignment of it) and said so. A "Points Possible" row, scores in points. Canvas's
  importer (``GradebookImporter``) takes a column ``Title (id)`` by its id, else an
  assignment of exactly that title, else makes a new one; it never changes an existing
  assignment's points (a warning says when the roster's differ from the lab's maximum),
  and a blank cell where Canvas has a score clears that score: a student who handed
  nothing in keeps the roster's value (blank only where the roster has none).
- **Feedback for Canvas** (:func:`write_canvas_feedback`): a zip per lab for the
  assignment's "Re-Upload Submissions", of plain-text files named
  ``name_uid_attid_feedback.txt``: Canvas takes the first two all-digit ``_`` parts of a
  name as the user and the submission's file it comments on.
- **nbgrader** (:func:`write_nbgrader`): scores as the ``auto_score`` of each graded cell of
  an nbgrader gradebook database, where ``nbgrader export`` reads them.
"""
from __future__ import annotations

import csv
import hashlib
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from .report import feedback_text, printable, spreadsheet_safe

CANVAS_ID = re.compile(r"[1-9][0-9]*")   # a Canvas id: ASCII digits, no leading zero
CANVAS_IDENTITY = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
LOGINS = ["SIS Login ID", "SIS User ID", "ID", "folder"]   # (and their ALIASES)
POINTS_POSSIBLE = "    Points Possible"
ZIP_LIMIT = 2 * 2**30              # bytes extracted from one download
ZIP_ENTRIES = 10_000               # entries of one zip (a download, or a student's upload)
KEPT = (".ipynb", ".zip")          # the files a download's zip gives with their bytes


@dataclass
class CanvasFile:
    name: str
    uid: str
    subid: str                     # the id of the submission's file (an attachment's)
    late: bool
    file: str


def canvas_files(filename: str) -> List[CanvasFile]:
    """Every way a file's name splits as a Canvas download's ``name[_LATE]_uid_attid_file``.
    Canvas's ``ContentZipper`` keeps a name's word characters only (lower-cased, ``_`` and
    digits included) and joins ``_<digits>_`` inside it, but a name can still end in
    ``_<digits>`` (``mal_101``) or hold one: then a name has several splits."""
    parts, found = Path(filename).name.split("_"), []
    for i in range(1, len(parts) - 2):
        name, late = "_".join(parts[:i]), False
        if name.upper().endswith("_LATE") or name.upper() == "LATE":
            name, late = name[:-5] if len(name) > 4 else "", True
        file = "_".join(parts[i + 2:])
        if (CANVAS_ID.fullmatch(parts[i]) and CANVAS_ID.fullmatch(parts[i + 1]) and file
                and re.fullmatch(r"\w*", name)):
            found.append(CanvasFile(name, parts[i], parts[i + 1], late, file))
    return found


def canvas_file(filename: str) -> Optional[CanvasFile]:
    """The parts of a Canvas download's file name when it splits one way only
    (:func:`canvas_files`), else None."""
    found = canvas_files(filename)
    return found[0] if len(found) == 1 else None


def canvas_name(sortable_name: str) -> str:
    """A user's (sortable) name as Canvas's ``ContentZipper`` writes it into a file's name."""
    return re.sub(r"\W", "", re.sub(r"_([0-9]+)_", r"\1", sortable_name).lower())


def unpack_zip(path, dest, prefix: str = "", limit: int = ZIP_LIMIT) -> Path:
    """The files of a zip (a Canvas download) extracted flat into ``dest`` as ``prefix`` and
    their names (never a path: no entry can land outside it), with the times the zip gives
    (a Canvas download's: when Canvas made the zip): notebooks and zips with their bytes
    (``limit`` in all), other files empty (their names say what was handed in); ``dest``."""
    import time
    dest, total = Path(dest), 0
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path) as z:
        if len(z.infolist()) > ZIP_ENTRIES:
            raise ValueError(f"{path}: more than {ZIP_ENTRIES} files in one zip")
        for info in z.infolist():
            name = Path(info.filename.replace("\\", "/")).name
            if info.is_dir() or not name or name.startswith("."):
                continue
            size = info.file_size if name.lower().endswith(KEPT) else 0
            total += size
            if total > limit:
                raise ValueError(f"{path}: more than {limit >> 20} MiB of notebooks and zips")
            target = dest / file_name(prefix + name)
            with z.open(info) as src, open(target, "wb") as out:
                out.write(src.read(size + 1)[:size])
            when = time.mktime(info.date_time + (0, 0, -1))
            os.utime(target, (when, when))
    return dest


def file_name(name: str) -> str:
    """``name`` as a file's name this file system takes: no NUL, 200 bytes at most (its
    start, a hash and its suffix where it was longer; a Canvas name's parts stay)."""
    data = os.fsencode(name.replace("\0", "?"))
    if len(data) <= 200:
        return os.fsdecode(data)
    start = data[:120].decode("utf-8", "ignore")
    return f"{start}~{hashlib.sha256(data).hexdigest()[:12]}{Path(name).suffix[:16]}"


# --- the roster -----------------------------------------------------------------------

@dataclass
class Roster:
    columns: List[str]             # the header as it is
    rows: List[Dict[str, str]]     # students, in the roster's order
    points: Dict[str, str] = field(default_factory=dict)   # Canvas's "Points Possible" row

    def match(self, name: str, uid: Optional[str] = None) -> Tuple[Optional[int], str]:
        """``(the index of the row a submission is, "")``, or ``(None, why none)``: by its
        Canvas user id ``uid`` where it has one and the roster has IDs; else by ``name``
        (a folder's) equal to a login of one row (:data:`LOGINS`), else to the display name
        (``Student``) of exactly one row. Exact, case included: "Bob" is not "bob"."""
        def rows_where(columns, wanted):
            return [i for i, row in enumerate(self.rows)
                    if wanted in {(value(row, c) or "").strip() for c in columns}]
        if uid and any(value(row, "ID") for row in self.rows):
            hits, what = rows_where(["ID"], uid), f"Canvas id {uid}"
        else:
            hits, what = rows_where(LOGINS, name), f"login {name!r}"
            if not hits:
                hits, what = rows_where(["Student"], name), f"name {name!r}"
        if len(hits) == 1:
            return hits[0], ""
        return None, f"{len(hits) or 'no'} roster rows have the {what}"

    def label(self, index: int) -> str:
        """A row as the instructor knows it: its name and id (bounded, printable)."""
        row = self.rows[index]
        name, uid = value(row, "Student") or "", value(row, "ID") or value(row, "SIS Login ID")
        return printable(f"{name[:60]} (ID {(uid or '?')[:20]})")


ALIASES = {"Student": ["name", "student name"], "ID": ["id", "canvas id", "user id"],
           "SIS User ID": ["sis_user_id"], "SIS Login ID": ["login", "sis_login_id", "email"],
           "Section": ["section"]}


def value(row: Dict[str, str], column: str) -> Optional[str]:
    """A roster row's value for ``column`` (any case, or one of its :data:`ALIASES`)."""
    if column in row:
        return row[column]
    lower = {k.lower().strip(): v for k, v in row.items() if k}
    for name in [column.lower()] + ALIASES.get(column, []):
        if name in lower:
            return lower[name]
    return None


def read_roster(path) -> Roster:
    """A roster CSV (Canvas's gradebook export as it comes: its "Points Possible" row, which
    has no ID, and muted-assignment rows are skipped)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        every = list(reader) if columns else []
    if not columns:
        raise ValueError(f"{path}: an empty roster (a CSV with a header is needed)")
    first = lambda r: (r.get(columns[0]) or "").strip()  # noqa: E731
    is_points = lambda r: first(r) == "Points Possible" and not value(r, "ID")  # noqa: E731
    points = next((r for r in every if is_points(r)), {})
    rows = [r for r in every if first(r) and not is_points(r)]
    return Roster(columns, rows, {c: (v or "").strip() for c, v in points.items()
                                  if c and c != columns[0] and (v or "").strip()})


# --- Canvas's import CSV -----------------------------------------------------------------

NOT_ASSIGNMENTS = re.compile(r"Current Score|Current Points|Current Grade|Final Score|"
                             r"Final Points|Final Grade|Override Score|Override Grade|"
                             r"Override Status")   # Canvas's own: its importer skips them
_WITH_ID = re.compile(r"^(?P<title>.*?)\s*\((?P<id>\d+)\)\s*$")


def _title(column: str) -> str:
    m = _WITH_ID.match(column)
    return (m["title"] if m else column).strip()


def _assignment_id(column: str) -> Optional[str]:
    m = _WITH_ID.match(column)
    return m["id"] if m else None


def assignment_columns(roster: Roster) -> List[str]:
    """The roster's columns that can be assignments: not a student's identity (Canvas's,
    :data:`LOGINS` and their :data:`ALIASES`), not one of Canvas's totals."""
    identity = {k.lower() for k in CANVAS_IDENTITY + LOGINS + ["student", "login", "email",
                                                                "Integration ID", "Root Account"]}
    identity |= {a for names in ALIASES.values() for a in names}
    return [c for c in roster.columns if c and c.strip().lower() not in identity
            and not NOT_ASSIGNMENTS.search(c) and c != roster.columns[0]]


def names_lab(column: str, lab: str) -> bool:
    """Does a Canvas column (``Title (id)``) name ``lab`` (``06_gradient_accumulation``)?
    Its title is the lab id, or names the lab's number: ``Lab 6``, ``Lab 06``, ``Lab-06``,
    ``LAB06``, ``Lab #6`` (anywhere in the title), or starts with it: ``6. ...``,
    ``06 ...``, ``06_...``; never another number (``Lab 16``, ``Lab 6.5``)."""
    title = _title(column).lower()
    if title == lab.lower():
        return True
    m = re.match(r"(\d+)(?:_|$)", lab)
    if not m:
        return False
    number = rf"0*{int(m.group(1))}(?!\d)(?![.,]\d)"
    return bool(re.search(rf"(?<![a-z0-9])lab\s*(?:no\.?\s*|#\s*)?[-_:.]?\s*{number}", title)
                or re.match(rf"{number}(?=$|[\s.:)_\-])", title))


def parse_assignments(specs: Iterable[str]) -> List[Tuple[str, str]]:
    """``--assignment LAB=ID|TITLE`` values as ``[(lab, target)]``; ValueError says what is
    wrong with one."""
    out = []
    for spec in specs or ():
        lab, sep, target = spec.partition("=")
        if not sep or not lab.strip() or not target.strip():
            raise ValueError(f"--assignment {spec!r}: give LAB=ID or LAB=TITLE "
                             "(06=5006, or \"06=Lab 6: Gradient accumulation\")")
        out.append((lab.strip(), target.strip()))
    return out


def labs_named(spec: str, labs: Iterable[str]) -> List[str]:
    """The labs of ``labs`` that ``spec`` names: a number (``06``), an id or a file name."""
    stem = spec[:-6] if spec.endswith(".ipynb") else spec
    def number(name):
        return int(name) if name.isdigit() else name
    return [lab for lab in labs if lab == stem or number(lab.split("_")[0]) == number(stem)]


def canvas_columns(labs: Iterable[str], roster: Optional[Roster],
                   assignments: Iterable[str] = ()) -> Tuple[Dict[str, Optional[str]], List[str]]:
    """``({lab: its column in Canvas's import, or None}, warnings)`` for ``labs``.

    ``assignments`` (``--assignment 06=5006``, ``06=Lab 6: ...``) map labs explicitly:
    to the roster's column with that id or title (without a roster: ``LAB (ID)``, or the
    title, which Canvas's importer matches itself). Every other lab takes the roster's one
    column that :func:`names_lab`; with none it is None (left out: the import would make
    a new assignment); without a roster, its id (a new assignment, warned). ValueError
    names the candidates when a lab has two, a target the roster lacks, a column taken
    twice."""
    labs = list(labs)
    columns = assignment_columns(roster) if roster else []
    listed = ", ".join(f'"{c}"' for c in columns) or "none"
    chosen: Dict[str, Optional[str]] = {}
    for spec, target in parse_assignments(assignments):
        found = labs_named(spec, labs)
        if len(found) > 1:
            raise ValueError(f"--assignment {spec}={target}: {spec} names labs "
                             f"{', '.join(found)}: give the lab id")
        if not found:
            continue                  # not a lab of this run
        lab = found[0]
        if roster is None:
            chosen[lab] = f"{lab} ({target})" if target.isdigit() else target
            continue
        hits = [c for c in columns if (_assignment_id(c) == target if target.isdigit()
                                       else c == target or _title(c).lower() == target.lower())]
        if len(hits) != 1:
            what = "no" if not hits else f"{len(hits)}"
            raise ValueError(f"--assignment {spec}={target}: {what} column of the roster is "
                             f"{'assignment ' if target.isdigit() else ''}{target!r} "
                             f"(its assignments: {listed})")
        chosen[lab] = hits[0]
    warnings = []
    for lab in labs:
        if lab in chosen:
            continue
        if roster is None:
            chosen[lab] = lab
            warnings.append(f"lab {lab}: no --roster, so its column is {lab!r}, which Canvas "
                            f"imports as a new assignment; map it to yours with --assignment "
                            f"{lab.split('_')[0]}=ID")
            continue
        taken = {c for c in chosen.values() if c}
        found = [c for c in columns if names_lab(c, lab) and c not in taken]
        if len(found) > 1:
            example = _assignment_id(found[0]) or found[0]
            raise ValueError(f"lab {lab} matches {len(found)} columns of the roster: "
                             f"{', '.join(repr(c) for c in found)}; choose one with "
                             f"--assignment {lab.split('_')[0]}={example}")
        chosen[lab] = found[0] if found else None
    free = ", ".join(f'"{c}"' for c in columns if c not in chosen.values()) or "none"
    for lab in labs:
        if roster is not None and chosen[lab] is None:
            warnings.append(f"lab {lab}: no column of the roster names it (its other "
                            f"assignments: {free}): left out of the import (Canvas would make a "
                            f"new assignment of it); map it with --assignment "
                            f"{lab.split('_')[0]}=ID or =TITLE")
    used: Dict[str, str] = {}
    for lab, column in chosen.items():
        if column and column in used:
            raise ValueError(f"labs {used[column]} and {lab} both map to the column {column!r}: "
                             "map each with --assignment")
        used.setdefault(column, lab)
    return chosen, warnings


def lab_column(lab: str, roster: Optional[Roster]) -> Optional[str]:
    """The roster's column for ``lab`` (:func:`canvas_columns` of that lab alone)."""
    return canvas_columns([lab], roster)[0][lab]


def _points(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "."))
    except (AttributeError, ValueError):
        return None


def write_canvas_csv(book, path, roster: Optional[Roster] = None,
                     assignments: Iterable[str] = ()) -> Tuple[List[str], List[str]]:
    """Canvas's gradebook import for ``book`` (:class:`~.gradebook.Gradebook`), the labs'
    columns by :func:`canvas_columns`; ``(students handed in who are not in the roster,
    warnings)``: labs left out or given a new assignment, and a roster's Points Possible
    other than the lab's maximum (Canvas keeps its own: the scores are in the lab's
    points)."""
    chosen, warnings = canvas_columns(book.labs, roster, assignments)
    labs = [lab for lab in book.labs if chosen[lab]]
    columns = [chosen[lab] for lab in labs]
    for lab, column in zip(labs, columns):
        theirs = _points(roster.points.get(column, "")) if roster else None
        if theirs is not None and abs(theirs - book.maxima[lab]) > 1e-9:
            warnings.append(f"{column!r} is out of {theirs:g} points in Canvas, lab {lab} out of "
                            f"{book.maxima[lab]:g}: the import writes the lab's points (full "
                            f"marks show as {book.maxima[lab]:g}/{theirs:g}) and never changes "
                            f"an assignment's points: set them to {book.maxima[lab]:g} in Canvas")
    identity = CANVAS_IDENTITY
    rows, seen, strangers = [], set(), []
    matched = book.roster_rows or (_rows_of(book, roster) if roster else {})
    ids = {(value(row, "ID") or "").strip() for row in (roster.rows if roster else [])}
    for row in (roster.rows if roster else []):
        student = next((s for s, r in matched.items() if r is row), None)
        seen.add(student)
        rows.append(([value(row, c) or "" for c in identity], student, row))
    for student in book.students:
        if student not in seen:
            strangers.append(student)
            uid = _uid(book, student) or ""
            if uid and uid in ids:      # one Canvas id, one row
                warnings.append(f"{student}: the Canvas id {uid} is another row's already: "
                                "written without an id")
                uid = ""
            ids.add(uid)
            rows.append(([student, uid, "", "", ""], student, {}))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([spreadsheet_safe(c) for c in identity + columns])
        writer.writerow([POINTS_POSSIBLE] + [""] * (len(identity) - 1)
                        + [f"{book.maxima[lab]:g}" for lab in labs])
        for who, student, row in rows:
            scores = [_score(book.counted(student, lab) if student else None, row.get(column))
                      for lab, column in zip(labs, columns)]
            writer.writerow([spreadsheet_safe(v) for v in who + scores])
    return strangers, warnings


def _score(grade, current: Optional[str] = None) -> str:
    """The cell: the counted notebook's score; else what Canvas has (the roster's value),
    since a blank cell clears a score in Canvas."""
    return (current or "").strip() if grade is None else f"{grade.score:g}"


def _rows_of(book, roster: Roster) -> Dict[str, Dict[str, str]]:
    """``{student: roster row}`` of a book made without :func:`~.handins.identify`."""
    found = {s: roster.match(s, _uid(book, s))[0] for s in book.students}
    return {s: roster.rows[i] for s, i in found.items() if i is not None}


def _uid(book, student: str) -> Optional[str]:
    """The Canvas user id that :mod:`.handins` gave a student's notebooks (one, or None)."""
    uids = {g.canvas[0] for g in book.grades if g.student == student and g.canvas}
    return uids.pop() if len(uids) == 1 else None


def write_canvas_feedback(book, folder) -> Tuple[List[Path], List[str]]:
    """``folder/<lab>.zip`` for each lab: a plain-text feedback file per counted notebook
    of a Canvas download, named ``name_uid_attid_feedback.txt`` (the ids of the file it
    came as, that :mod:`.handins` read once: a download's flat file), which Canvas's
    "Re-Upload Submissions" of that lab's assignment attaches as a comment to that
    student's submission. ``(zips written, notebooks left out and why)``: those with no
    Canvas ids, and a second notebook of the same ids (never one file for two)."""
    folder, written, skipped = Path(folder), [], []
    folder.mkdir(parents=True, exist_ok=True)
    for lab in book.labs:
        files, ids = {}, set()
        for student in book.students:
            g = book.counted(student, lab)
            if g is None:
                continue
            if g.canvas is None:
                skipped.append(f"{g.path} ({student}, {lab}): no Canvas ids (only a download's "
                               "flat file name_uid_attid_file, not in a student's folder, not "
                               "ambiguous, has them): Canvas could not tell whose it is")
                continue
            if g.canvas in ids:
                skipped.append(f"{g.path} ({student}, {lab}): another notebook has its Canvas "
                               f"ids ({'_'.join(g.canvas)}): this one is left out")
                continue
            ids.add(g.canvas)
            who = re.sub(r"[^a-z]", "", student.lower())[:40] or "student"   # no digits
            files[f"{who}_{'_'.join(g.canvas)}_feedback.txt"] = feedback_text(student, lab, g)
        if files:
            path = folder / f"{lab}.zip"
            with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
                for name, text in sorted(files.items()):
                    z.writestr(name, text)
            written.append(path)
    return written, skipped


# --- nbgrader ------------------------------------------------------------------------------

def write_nbgrader(book, db: str, assignment: Optional[str] = None) -> Tuple[int, List[str]]:
    """Each counted notebook's exercise scores as the ``auto_score`` of its graded cells in
    the nbgrader gradebook ``db`` (a path or an SQLAlchemy URL), where ``nbgrader export``
    reads them. The assignment is ``assignment``, else the notebook's folder (nbgrader's
    ``submitted/<student>/<assignment>/<notebook>.ipynb``); the notebook is the lab id
    when the assignment has a notebook of that name, else the file's stem. The assignment
    and its notebooks must be in the database (``nbgrader generate_assignment``); students
    and submissions are added. ``(grades written, notebooks skipped and why)``."""
    import sys
    import warnings
    here = os.path.dirname(sys.executable)  # nbgrader runs `alembic` from PATH: this Python's
    if here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    from nbgrader.api import Gradebook as NbgraderBook, MissingEntry
    url = db if "://" in db else f"sqlite:///{Path(db).resolve()}"
    written, skipped = 0, []
    with warnings.catch_warnings(), NbgraderBook(url) as gb:
        warnings.simplefilter("ignore")          # SQLAlchemy's, about nbgrader's own session use
        for g in book.counted_grades():
            name = assignment or Path(g.path).parent.name
            try:
                names = {n.name for n in gb.find_assignment(name).notebooks}
            except MissingEntry:
                skipped.append(f"{g.path}: no assignment {name!r} in {db}")
                continue
            notebook = g.lab if g.lab in names else Path(g.path).stem
            if notebook not in names:
                skipped.append(f"{g.path}: no notebook {g.lab!r} in assignment {name!r}")
                continue
            try:
                gb.find_student(g.student)
            except MissingEntry:
                gb.add_student(g.student)
            try:
                gb.find_submission(name, g.student)
            except MissingEntry:
                gb.add_submission(name, g.student)
            for e in g.exercises:
                try:
                    grade = gb.find_grade(e.grade_id, notebook, name, g.student)
                except MissingEntry:
                    skipped.append(f"{g.path}: no graded cell {e.grade_id!r} in {notebook!r}")
                    continue
                grade.auto_score = e.score
                written += 1
            gb.db.commit()
    return written, skipped
