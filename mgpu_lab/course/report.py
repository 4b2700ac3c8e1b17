"""What the grader writes: a table on screen, JSON, CSV, a feedback file per student.

Messages are bounded (:func:`mgpu_lab.course.scoring.brief`: a few hundred
characters) and never carry text the learner's code chose (:mod:`.scoring`). What the
learner still names (a folder, a file) is written so that nothing reads it as code: a
CSV cell a spreadsheet would take for a formula gets a leading ``'`` (OWASP's rule:
``= + - @``, tab, carriage return), and feedback escapes markdown and HTML. One
student's report that cannot be written costs that file only.
"""
from __future__ import annotations

import csv
import html
import json
import re
import sys
from pathlib import Path
from typing import Dict, List

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
    text = html.escape(" ".join(str(text).split()), quote=False)
    text = _MARKDOWN.sub(r"\\\1", text)
    return re.sub(r"(?i)www\.", "www\\.", text)

FEEDBACK_LIMIT = 300


def by_student(grades) -> Dict[str, Dict[str, object]]:
    """``{student: {lab: grade}}``; of two notebooks for one lab, the better one counts."""
    table: Dict[str, Dict[str, object]] = {}
    for g in grades:
        labs = table.setdefault(g.student, {})
        key = g.lab or f"?{Path(g.path).name}"
        if key in labs and g.lab:
            other = labs[key]
            best, worse = (g, other) if g.score > other.score else (other, g)
            note = f"also submitted {worse.path} ({worse.score:g}): the better counts"
            if note not in best.notes:
                best.notes.append(note)
            labs[key] = best
        else:
            labs[key] = g
    return table


def printable(text) -> str:
    """``text`` without control characters (a terminal's escape sequences)."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def print_table(grades, sandbox_line: str, file=None) -> None:
    file = file or sys.stdout
    table = by_student(grades)
    for student in sorted(table):
        for lab, g in sorted(table[student].items()):
            head = printable(f"{student}  {lab}  {g.score:g}/{g.max_score:g}  ({g.seconds:.1f} s)")
            head += f"  [{g.error}]" if g.error else ""
            head += f"  [TAMPERING: {len(g.tampering)} finding(s)]" if g.tampering else ""
            print(head, file=file)
            width = max([len("grade_id")] + [len(e.grade_id) for e in g.exercises])
            for e in g.exercises:
                why = f"{e.error}: {e.message}" if e.error and e.message else e.error or ""
                why = printable(why)
                print(f"    {e.grade_id:<{width}}  {e.score:4g}/{e.max_score:<4g}  "
                      f"{why if len(why) <= 100 else why[:97] + '...'}", file=file)
            for e in g.exercises:
                if e.observed:
                    print(f"    note: {e.grade_id} observes your kernel, not tamper-proof: "
                          f"{e.observed}", file=file)
            for what in g.tampering:
                print(f"    tampering: {printable(what)}", file=file)
            for note in g.notes:
                print(f"    note: {printable(note)}", file=file)
    if len(grades) > 1:
        print(f"total: {sum(g.score for g in grades):g}/{sum(g.max_score for g in grades):g} "
              f"over {len(grades)} notebooks, {len(table)} students", file=file)
    print(sandbox_line, file=file)


def write_json(grades, path, sandbox_line: str) -> None:
    students = {s: {lab: g.to_dict() for lab, g in labs.items()}
                for s, labs in by_student(grades).items()}
    data = {"sandbox": sandbox_line, "notebooks": [g.to_dict() for g in grades],
            "students": students}
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_csv(grades, path) -> None:
    """One row per student; per lab a total column, then one column per exercise."""
    table = by_student(grades)
    columns: List[str] = []
    for g in grades:
        if not g.lab:
            continue
        for key in ([g.lab] + [f"{g.lab}:{e.grade_id}" for e in g.exercises]
                    + [f"{g.lab}:tampering"]):
            if key not in columns:
                columns.append(key)
    columns.sort(key=lambda c: (c.split(":")[0], ":" in c))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([spreadsheet_safe(c) for c in ["student", "total", "max_total"] + columns])
        for student in sorted(table):
            cells = {}
            labs = [g for lab, g in table[student].items() if g.lab]
            for g in labs:
                cells[g.lab] = g.score
                cells.update({f"{g.lab}:{e.grade_id}": e.score for e in g.exercises})
                cells[f"{g.lab}:tampering"] = len(g.tampering) or ""
            row = [student, sum(g.score for g in labs), sum(g.max_score for g in labs)]
            writer.writerow([spreadsheet_safe(v) for v in row + [cells.get(c, "") for c in columns]])


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "unnamed"


def write_feedback(grades, folder) -> List[Path]:
    """``folder/<student>/<lab>.md``: each exercise, its points, the failure's message
    (every text a learner could have chosen escaped: :func:`markdown_safe`)."""
    written = []
    for student, labs in by_student(grades).items():
        for lab, g in labs.items():
            try:
                written.append(_feedback(folder, student, lab, g))
            except Exception as err:   # this file only: the others are still written
                print(f"mgpu-lab grade: no feedback for {student!r} {lab!r}: {err}",
                      file=sys.stderr)
    return written


def _feedback(folder, student: str, lab: str, g) -> Path:
    def md(text) -> str:
        return markdown_safe(str(text)[:FEEDBACK_LIMIT])
    lines = [f"# {md(lab)}: {g.score:g} / {g.max_score:g}", "",
             f"Student: {md(student)}  ", f"Notebook: {md(Path(g.path).name)}", ""]
    if g.error:
        lines += [f"**Not graded:** {md(g.error)}", ""]
    if g.exercises:
        lines += ["| exercise | points | result |", "|---|---|---|"]
        for e in g.exercises:
            result = "passed" if not e.error else md(f"{e.error}: {e.message}" if e.message
                                                      else e.error)
            lines.append(f"| {md(e.grade_id)} | {e.score:g} / {e.max_score:g} | {result} |")
        lines.append("")
    lines += [f"- tampering: {md(t)}" for t in g.tampering]
    lines += [f"- {md(e.grade_id)} observes your kernel (not tamper-proof): {md(e.observed)}"
              for e in g.exercises if e.observed]
    lines += [f"- {md(n)}" for n in g.notes]
    path = Path(folder) / _safe(student) / f"{_safe(lab)}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
