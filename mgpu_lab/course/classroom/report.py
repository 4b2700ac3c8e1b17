"""What the grader writes: a summary on screen, the instructor's report, JSON, CSV, and
a feedback file per student and lab (all from one :class:`~.gradebook.Gradebook`).

The summary is one line per student with a column per lab; per-notebook details (each
exercise's outcome, tampering findings, notes, what a check observes in the kernel) go
to the instructor's report (``--report``, ``--details``) and the JSON, never to a
student's feedback.

Messages are bounded (:func:`mgpu_lab.course.grading.scoring.brief`: a few hundred
characters) and never carry text the learner's code chose (:mod:`~mgpu_lab.course.grading.scoring`). What the
learner still names (a folder, a file) is written so that nothing reads it as code: a
CSV cell a spreadsheet would take for a formula gets a leading ``'`` (OWASP's rule:
``= + - @``, tab, carriage return), and markdown feedback escapes markdown and HTML;
plain-text feedback (:func:`feedback_text`, what Canvas attaches) has nothing to escape:
control characters go. One student's report that cannot be written costs that file only.
"""
from __future__ import annotations

import csv
import hashlib
import html
import json
import re
import sys
from pathlib import Path
from typing import List, Optional

from ..grading.misconceptions import label as label_of
from .gradebook import as_gradebook

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_MARKDOWN = re.compile(r"([\\`*_\[\]()#+\-!|~:{}])")


def spreadsheet_safe(value):
    """A CSV cell no spreadsheet runs: a string that starts like a formula gets a ``'``."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def markdown_safe(text) -> str:
    """``text`` on one line, shown as it is by a markdown (and HTML) renderer: no tag, no
    link, no emphasis, no table cell boundary."""
    text = html.escape(" ".join(printable(text).split()), quote=False)
    text = _MARKDOWN.sub(r"\\\1", text)
    return re.sub(r"(?i)www\.", "www\\.", text)

FEEDBACK_LIMIT = 300
OUTCOME_LIMIT = 1400  # an exercise's outcome: the failure (1000) and the misconception it shows
SHOWN = 400          # characters of a line that shows a path


def printable(text, limit: Optional[int] = None) -> str:
    """``text`` without control characters (a terminal's escape sequences) nor undecodable
    bytes of a name; cut to ``limit`` characters if given."""
    text = str(text)
    text = text if limit is None or len(text) <= limit else text[:limit - 3] + "..."
    return "".join(c if c.isprintable() else "?" for c in text)


def lab_label(lab: str, labs: List[str]) -> str:
    """A lab's column on screen: its number (``06``) when no other lab of the run has it."""
    number = lab.split("_")[0]
    return number if sum(1 for x in labs if x.split("_")[0] == number) == 1 else lab


def print_summary(grades, sandbox_line: str, file=None) -> None:
    """One line per student, a column per lab (the notebook that counts), the total; the
    notebooks of no lab after it. Per-notebook details: :func:`print_details`."""
    file, book = file or sys.stdout, as_gradebook(grades)
    labels = [lab_label(lab, book.labs) for lab in book.labs]
    cells = {s: [_cell(book.counted(s, lab), book.maxima[lab]) for lab in book.labs]
             for s in book.students}
    names = {s: printable(s) for s in book.students}
    width = max([len("student")] + [len(n) for n in names.values()])
    widths = [max([len(label)] + [len(cells[s][i]) for s in book.students])
              for i, label in enumerate(labels)]
    print("  ".join([f"{'student':<{width}}"] + [f"{lab:>{w}}" for lab, w in zip(labels, widths)]
                    + ["total"]), file=file)
    for s in book.students:
        print("  ".join([f"{names[s]:<{width}}"] + [f"{c:>{w}}" for c, w in zip(cells[s], widths)]
                        + [f"{book.total(s):g}/{book.max_total:g}"]), file=file)
    for s, notebooks in sorted(book.unmatched.items()):
        for g in notebooks:
            print(printable(f"not graded: {s}: {g.path}: {g.error or 'no lab'}", SHOWN),
                  file=file)
    for notice in book.notices:
        print(printable(notice, SHOWN), file=file)
    if book.students:
        counted = sum(len(book.entries[s]) for s in book.students)
        flags = "; ".join(f for f, seen in (
            ("T: tampering found", any(g.tampering for g in book.counted_grades())),
            ("!: not graded (see the report)", any(g.error for g in book.counted_grades())))
            if seen)
        print(f"class: {sum(book.total(s) for s in book.students):g}/"
              f"{book.max_total * len(book.students):g} over {len(book.students)} students, "
              f"{counted} notebook(s) counted of {len(book.grades)} (policy {book.policy})"
              + (f"; {flags}" if flags else ""), file=file)
    for line in misconception_lines(book):
        print(line, file=file)
    print(sandbox_line, file=file)


def misconception_lines(grades) -> List[str]:
    """The class's known misconceptions, per lab and exercise: ``01 my_scatter: 2 of 30 —
    tensor split always n chunks`` (of the students whose notebook for the lab counts)."""
    book = as_gradebook(grades)
    counts = book.misconceptions()
    lines = ["misconceptions shown (students, of those who handed the lab in):"] if counts else []
    for lab, per_exercise in counts.items():
        label = lab_label(lab, book.labs)
        for gid, (of, found) in per_exercise.items():
            for name, n in found.items():
                lines.append(printable(f"  {label} {gid}: {n} of {of} \u2014 {label_of(name)}", SHOWN))
    return lines


def _cell(g, maximum: float) -> str:
    if g is None:
        return "-"
    return f"{g.score:g}/{maximum:g}" + ("!" if g.error else "") + ("T" if g.tampering else "")


def print_details(grades, file=None) -> None:
    """Every notebook (counted or not) with each exercise, its tampering findings and
    notes, and what its checks observe in the kernel: the instructor's report."""
    file, book = file or sys.stdout, as_gradebook(grades)
    for g in sorted(book.grades, key=lambda g: (g.student, g.lab or "", g.path)):
        head = printable(f"{g.student}  {g.lab or '?'}  {g.score:g}/{g.max_score:g}  "
                         f"{g.path}  ({g.seconds:.1f} s)", SHOWN)
        head += f"  [{g.error}]" if g.error else ""
        head += f"  [TAMPERING: {len(g.tampering)} finding(s)]" if g.tampering else ""
        print(head, file=file)
        width = max([len("grade_id")] + [len(e.grade_id) for e in g.exercises])
        for e in g.exercises:
            why = printable("" if not e.error else f"{e.error}: {e.message}" if e.message else e.error)
            known = f" [misconception: {printable(e.misconception, 80)}]" if e.misconception else ""
            print(f"    {e.grade_id:<{width}}  {e.score:4g}/{e.max_score:<4g}  "
                  f"{why if len(why) <= 100 else why[:97] + '...'}{known}", file=file)
        for e in g.exercises:
            if e.observed:
                print(f"    note: {e.grade_id} observes the kernel, not tamper-proof: "
                      f"{e.observed}", file=file)
        for what in g.tampering:
            print(f"    tampering: {printable(what)}", file=file)
        for note in g.notes:
            print(f"    note: {printable(note)}", file=file)


def write_report(grades, path, sandbox_line: str) -> None:
    """The instructor's report: the summary, then every notebook's details."""
    import io
    out = io.StringIO()
    print_summary(grades, sandbox_line, file=out)
    print("", file=out)
    print_details(grades, file=out)
    Path(path).write_text(out.getvalue(), encoding="utf-8")


def write_json(grades, path, sandbox_line: str) -> None:
    """Everything: every notebook, and per student the notebook that counts for each lab."""
    book = as_gradebook(grades)
    students = {s: {"total": book.total(s), "max_total": book.max_total,
                    "labs": {lab: e.counted.to_dict() for lab, e in book.entries[s].items()},
                    "not_counted": [o.path for e in book.entries[s].values() for o in e.others]}
                for s in book.students}
    data = {"sandbox": sandbox_line, "policy": book.policy, "labs": book.maxima,
            "notebooks": [g.to_dict() for g in book.grades], "students": students,
            "notices": book.notices,
            "misconceptions": {lab: {gid: {"of": of, "students": dict(found)}
                                     for gid, (of, found) in per.items()}
                               for lab, per in book.misconceptions().items()}}
    Path(path).write_text(json.dumps(_valid_unicode(data), indent=2) + "\n", encoding="utf-8")


def _valid_unicode(value):
    """``value`` with every string valid Unicode: a name that was not valid UTF-8 on disk
    (decoded with surrogate escapes) gets U+FFFD for its bad bytes, as the other reports do;
    a strict JSON reader would refuse a lone surrogate."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_valid_unicode(k): _valid_unicode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_valid_unicode(v) for v in value]
    return value


def write_csv(grades, path) -> None:
    """One row per student: total and maximum (every lab of the run), then per lab its
    total, one column per exercise and its tampering findings (blank: not handed in)."""
    book = as_gradebook(grades)
    columns: List[str] = []
    for lab in book.labs:
        exercises = next((g.exercises for g in book.grades if g.lab == lab and g.exercises), [])
        columns += [lab] + [f"{lab}:{e.grade_id}" for e in exercises] + [f"{lab}:tampering"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([spreadsheet_safe(c) for c in ["student", "total", "max_total"] + columns])
        for student in book.students:
            cells = {}
            for lab, entry in book.entries[student].items():
                g = entry.counted
                cells[lab] = g.score
                cells.update({f"{lab}:{e.grade_id}": e.score for e in g.exercises})
                cells[f"{lab}:tampering"] = len(g.tampering) or ""
            row = [student, book.total(student), book.max_total]
            writer.writerow([spreadsheet_safe(v) for v in row + [cells.get(c, "") for c in columns]])


def _safe(name: str) -> str:
    """A file name for ``name``: itself when plain (lower-case letters, digits, ``_.-``, no
    dot at either end, 64 at most), else its plain part, ``~`` and a hash of it: distinct
    names, distinct files, on any file system (one blind to case too)."""
    if re.fullmatch(r"[a-z0-9_-]([a-z0-9_.-]{0,62}[a-z0-9_-])?", name):
        return name
    plain = re.sub(r"[^a-z0-9_.-]+", "_", name.lower()).strip("._")[:40]
    return f"{plain}~{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


def write_feedback(grades, folder) -> List[Path]:
    """``folder/<student>/<lab>.md`` for the notebook that counts (and one per notebook
    that could not be matched to a lab): each exercise by its title, its points and
    :meth:`~mgpu_lab.course.grading.scoring.ExerciseScore.outcome` (every text a learner could have chosen
    escaped: :func:`markdown_safe`), and the notes a student needs (which notebook
    counted, the lab version). What checks observe in the kernel is the instructor's."""
    book, written = as_gradebook(grades), []
    todo = [(s, lab, e.counted) for s in book.students for lab, e in book.entries[s].items()]
    todo += [(s, f"?{Path(g.path).name}", g) for s, gs in book.unmatched.items() for g in gs]
    for student, lab, g in todo:
        try:
            written.append(_feedback(folder, student, lab, g))
        except Exception as err:   # this file only: the others are still written
            print(f"mgpu-lab grade: no feedback for {student!r} {lab!r}: {err}",
                  file=sys.stderr)
    return written


def feedback_text(student: str, lab: str, g) -> str:
    """A student's feedback for one notebook as plain text (no markup, nothing escaped but
    control characters): what :func:`write_feedback` says, for a platform that shows files
    as they are (Canvas's comments, :func:`.lms.write_canvas_feedback`)."""
    def txt(text, limit=FEEDBACK_LIMIT) -> str:
        return printable(" ".join(str(text)[:limit].split()))
    lines = [f"{txt(lab)}: {g.score:g} / {g.max_score:g}", "",
             f"Student: {txt(student)}", f"Notebook: {txt(Path(g.path).name)}", ""]
    if g.error:
        lines += [f"Not graded: {txt(g.error)}", ""]
    if g.exercises:
        names = [txt(e.title or e.grade_id) for e in g.exercises]
        width = max(len(n) for n in names)
        for name, e in zip(names, g.exercises):
            lines.append(f"{name:<{width}}  {e.score:g} / {e.max_score:g}  {txt(e.outcome(), OUTCOME_LIMIT)}")
        lines.append("")
    lines += [f"- {txt(n)}" for n in g.notes]
    return "\n".join(lines).rstrip() + "\n"


def _feedback(folder, student: str, lab: str, g) -> Path:
    def md(text, limit=FEEDBACK_LIMIT) -> str:
        return markdown_safe(str(text)[:limit])
    lines = [f"# {md(lab)}: {g.score:g} / {g.max_score:g}", "",
             f"Student: {md(student)}  ", f"Notebook: {md(Path(g.path).name)}", ""]
    if g.error:
        lines += [f"**Not graded:** {md(g.error)}", ""]
    if g.exercises:
        lines += ["| exercise | points | result |", "|---|---|---|"]
        for e in g.exercises:
            lines.append(f"| {md(e.title or e.grade_id)} | {e.score:g} / {e.max_score:g} | "
                         f"{md(e.outcome(), OUTCOME_LIMIT)} |")
        lines.append("")
    lines += [f"- {md(n)}" for n in g.notes]
    path = Path(folder) / _safe(student) / f"{_safe(lab)}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
