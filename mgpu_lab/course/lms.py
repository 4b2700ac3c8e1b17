"""Gradebooks of learning-management systems: Canvas in and out, a roster, nbgrader.

- **A Canvas submissions download as it comes**: the zip (or its unzipped folder) of
  files named ``name_uid_subid_file`` (``name_LATE_uid_subid_file`` when late;
  ``lab-1.ipynb`` when re-uploaded). :func:`canvas_file` reads such a name: the student
  is ``name`` (``name_uid`` where two students share a name), and ``uid`` is the Canvas
  user id that a roster matches. :func:`unpack_zip` extracts a download's files (a zip a
  student uploaded is unpacked by :mod:`.handins`).
- **A roster** (``--roster roster.csv``, :func:`read_roster`): Canvas's gradebook export
  as it comes, or any CSV with a header. A submission is a row's (:meth:`Roster.match`)
  by its Canvas user id, else by a login (:data:`LOGINS`), else by a display name that
  exactly one row has; never by a name two rows share.
- **Canvas's import CSV** (:func:`write_canvas_csv`): Canvas's identity columns
  (:data:`CANVAS_IDENTITY`, from the roster), one column per lab (a roster's own column
  for that lab when it has one, so that the import updates it; else the lab id, which
  Canvas imports as a new assignment), a "Points Possible" row, scores in points; blank
  where nothing was handed in (Canvas leaves those grades as they are).
- **nbgrader** (:func:`write_nbgrader`): scores as the ``auto_score`` of each graded cell of
  an nbgrader gradebook database, where ``nbgrader export`` reads them.
"""
from __future__ import annotations

import csv
import hashlib
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .report import printable, spreadsheet_safe

CANVAS_NAME = re.compile(r"^(?P<name>[^_/\\]+?)(?P<late>_late)?_(?P<uid>\d+)_(?P<subid>\d+)_"
                         r"(?P<file>.+)$", re.I)
CANVAS_IDENTITY = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
LOGINS = ["SIS Login ID", "SIS User ID", "ID", "folder"]   # (and their ALIASES)
POINTS_POSSIBLE = "    Points Possible"
ZIP_LIMIT = 2 * 2**30              # bytes extracted from one download
KEPT = (".ipynb", ".zip")          # the files a download's zip gives with their bytes


@dataclass
class CanvasFile:
    name: str
    uid: str
    subid: str
    late: bool
    file: str


def canvas_file(filename: str) -> Optional[CanvasFile]:
    """The parts of a Canvas download's file name, or None when it is not one."""
    m = CANVAS_NAME.match(Path(filename).name)
    if not m:
        return None
    return CanvasFile(m["name"], m["uid"], m["subid"], bool(m["late"]), m["file"])


def unpack_zip(path, dest, prefix: str = "", limit: int = ZIP_LIMIT) -> Path:
    """The files of a zip (a Canvas download) extracted flat into ``dest`` as ``prefix`` and
    their names (never a path: no entry can land outside it), with their times kept:
    notebooks and zips with their bytes (``limit`` in all), other files empty (their names
    say what was handed in); ``dest``."""
    import time
    dest, total = Path(dest), 0
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path) as z:
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
    """A roster CSV (Canvas's gradebook export as it comes: its "Points Possible" and
    muted-assignment rows are skipped)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        rows = [r for r in reader
                if (r.get(columns[0]) or "").strip() not in ("Points Possible", "")]
    if not columns:
        raise ValueError(f"{path}: an empty roster (a CSV with a header is needed)")
    return Roster(columns, rows)


# --- Canvas's import CSV -----------------------------------------------------------------

def lab_column(lab: str, roster: Optional[Roster]) -> str:
    """The roster's column for ``lab`` ("00_setup (1234)", "Lab 00 (1234)": Canvas's
    assignment names with their ids), else the lab id (a new assignment)."""
    number = lab.split("_")[0]
    for column in (roster.columns if roster else []):
        name = re.sub(r"\s*\(\d+\)\s*$", "", column).strip().lower()
        if name == lab.lower() or re.fullmatch(rf"(lab\s*)?{re.escape(number)}\b.*", name):
            return column
    return lab


def write_canvas_csv(book, path, roster: Optional[Roster] = None) -> List[str]:
    """Canvas's gradebook import for ``book`` (:class:`~.gradebook.Gradebook`); the
    students handed in who are not in the roster (each warned about)."""
    columns = [lab_column(lab, roster) for lab in book.labs]
    identity = CANVAS_IDENTITY
    rows, seen, strangers = [], set(), []
    matched = book.roster_rows or (_rows_of(book, roster) if roster else {})
    for row in (roster.rows if roster else []):
        student = next((s for s, r in matched.items() if r is row), None)
        seen.add(student)
        rows.append(([value(row, c) or "" for c in identity], student))
    for student in book.students:
        if student not in seen:
            strangers.append(student)
            uid = _uid(book, student) or ""
            rows.append(([student, uid, "", "", ""], student))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([spreadsheet_safe(c) for c in identity + columns])
        writer.writerow([POINTS_POSSIBLE] + [""] * (len(identity) - 1)
                        + [f"{book.maxima[lab]:g}" for lab in book.labs])
        for who, student in rows:
            scores = [_score(book.counted(student, lab)) if student else "" for lab in book.labs]
            writer.writerow([spreadsheet_safe(v) for v in who + scores])
    return strangers


def _score(grade) -> str:
    return "" if grade is None else f"{grade.score:g}"


def _rows_of(book, roster: Roster) -> Dict[str, Dict[str, str]]:
    """``{student: roster row}`` of a book made without :func:`~.handins.identify`."""
    found = {s: roster.match(s, _uid(book, s))[0] for s in book.students}
    return {s: roster.rows[i] for s, i in found.items() if i is not None}


def _uid(book, student: str) -> Optional[str]:
    for g in book.grades:
        if g.student == student:
            found = canvas_file(g.path)
            if found:
                return found.uid
    return None


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
