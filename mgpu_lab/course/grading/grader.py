"""The autograder: score a class's notebooks, each in a sandboxed fresh kernel.

    mgpu-lab grade PATH... [--root DIR | --solutions DIR] [--lab NN...] [--policy P]
                   [--json FILE] [--csv FILE] [--report FILE] [--feedback DIR]
                   [--roster CSV] [--canvas FILE] [--nbgrader DB] [--jobs N]
                   [--timeout S] [--total-timeout S] [--no-sandbox [--run-as USER]]
                   [--memory GIB]

PATH is a notebook, or a class folder: ``DIR/<student>/**/*.ipynb`` (so
nbgrader's ``submitted/<student>/<lab>/`` too) and flat ``DIR/*.ipynb`` (the
student is the file's stem). A submission is matched to its lab by the lab id
that ``labs build`` writes into every notebook (``metadata.mgpu_lab.lab``), or
else by its graded cells' ids, never by file name; one that matches no lab gets
a line in the report and the run goes on.

Before running, every graded cell is the instructor's (hidden tests included):
an edited one is replaced, a duplicated one runs once (its last copy), a deleted
one is put back after its exercise (scored 0, "Missing", when the exercise is
gone too). Cells tagged ``demo`` are not run. A graded cell is split in three
(:mod:`mgpu_lab.course.notebook.graded_cell`): its inputs and judge run in a judge
process of ours (:mod:`.judge`), its probe in the sandboxed kernel; it scores its
points when the probe and the judge raise nothing, the learner's cells show no
tampering (:mod:`.tamper`) and, for a from-scratch exercise, no reference it
re-implements is called (a courtesy message, :mod:`.guard`); :mod:`.scoring` holds
that order. The run itself is :mod:`.session`'s. Cells have ``--timeout`` seconds,
the notebook ``--total-timeout``; a dead kernel is restarted and the earlier cells
replayed (:mod:`.kernel`). Everything runs in a sandbox (:mod:`.sandbox`): without
one the command refuses unless told ``--no-sandbox``; the first line says which. The
exit status is 0 whatever the scores; 1 when the grader itself failed on a notebook;
2 on bad usage.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path
from time import monotonic
from typing import Dict, Optional

import nbformat

from ..notebook import graded_cell
from ..notebook.cells import (exercise_of, given_statements, graded_cells, lab_id,
                              nbgrader_meta, observed_of, parse)
from ..notebook.exercises import lab_version, submitted_version, syntax_error, titles, untouched
from .guard import called_in, forbidden_of, notebook_violations
from .hidden import WITHHELD, hidden_lines, shows_hidden, visible_line
from .kernel import OOM_MESSAGE
from .misconceptions import hint as misconception_hint
from .sandbox import Limits, Sandbox
from .scoring import (Evidence, ExerciseScore, NotebookGrade, brief, kernel_error, score,
                      verdict_text)
from .session import run_prepared
from .submission import prepare_submission
from .tamper import tampering

__all__ = ["ExerciseScore", "NotebookGrade", "brief", "grade_notebook", "load_solutions",
           "match_lab"]


# --- which lab is this? -----------------------------------------------------

def load_solutions(solutions) -> Dict[str, nbformat.NotebookNode]:
    """``{lab id: instructor notebook}`` for every notebook in ``solutions``."""
    labs = {}
    for path in sorted(Path(solutions).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        labs[lab_id(nb) or path.stem] = nb
    return labs


def _grade_ids(nb) -> set:
    return {nbgrader_meta(c).get("grade_id") for c in nb.cells} - {None}


def match_lab(student, labs: Dict[str, nbformat.NotebookNode]):
    """``(lab id, how)`` or ``(None, why not)``: by metadata, else by grade ids."""
    wanted = lab_id(student)
    if wanted in labs:
        return wanted, "lab id"
    ids = _grade_ids(student)
    overlap = sorted(((len(ids & _grade_ids(nb)), lab) for lab, nb in labs.items()), reverse=True)
    if overlap and overlap[0][0] > 0 and (len(overlap) == 1 or overlap[1][0] < overlap[0][0]):
        return overlap[0][1], "graded cell ids"
    if wanted:
        return None, f"its lab id {wanted!r} names no lab in the solutions folder"
    return None, "no lab id and no graded cell of any lab: not a lab notebook?"


# --- grading it ----------------------------------------------------------------

STATIC_TIMEOUT = 60.0              # seconds for the static pass of one notebook
NOTEBOOK_LIMIT = 32 * 2**20         # bytes of a submission
CELL_LIMIT = 2**20                  # characters of one code cell the static pass reads


class Unanalysable(Exception):
    """The static pass could not read a submission (in time, or at all)."""


def static_pass(submission, instructor, limit: Optional[float] = None):
    """``(tampering findings, {grade_id: references called})`` of the learner's cells,
    read, never run, nor anything they name imported (:mod:`.tamper`, :mod:`.guard`);
    :class:`Unanalysable` past ``limit`` seconds or on a cell too odd to read."""
    limit = STATIC_TIMEOUT if limit is None else limit
    end = monotonic() + limit

    def check():
        if monotonic() > end:
            raise Unanalysable(f"the static pass ran past {limit:g} s")
    if any(len(c.source) > CELL_LIMIT for c in submission.cells if c.cell_type == "code"):
        raise Unanalysable(f"a code cell of more than {CELL_LIMIT} characters")
    try:
        given = given_statements(instructor)
        return (tampering(submission, instructor, given, check),
                notebook_violations(submission, instructor, given, check))
    except Unanalysable:
        raise
    except (RecursionError, MemoryError, ValueError, SyntaxError, TypeError) as err:
        raise Unanalysable(f"{type(err).__name__} while reading its cells") from None


def grade_notebook(path, labs, student: str = "", box: Optional[Sandbox] = None,
                   limits: Optional[Limits] = None, timeout: float = 120.0,
                   total_timeout: Optional[float] = 1800.0, pool=None,
                   folder: Optional[str] = None) -> NotebookGrade:
    """Score one submission against the matching lab in ``labs`` (see :func:`load_solutions`):
    read it, match its lab, prepare it, read it statically, run it, score each graded cell.
    ``pool``: the run's :class:`~mgpu_lab.course.grading.judge_pool.JudgePool` (None: a judge
    process of its own); ``folder``: the real folder the notebook must lie in (a
    symbolic link out of it is refused, never read)."""
    from .sandbox import probe
    path, start = Path(path), monotonic()
    box = box or probe()
    grade = NotebookGrade(str(path), path.name, student or path.stem, sandboxed=box.available)
    real = os.path.realpath(path)
    if folder is not None and not real.startswith(os.path.join(folder, "")):
        grade.error = "Refused: a symbolic link out of the submission folder"
        return grade
    try:
        if os.path.getsize(real) > NOTEBOOK_LIMIT:
            raise ValueError(f"larger than {NOTEBOOK_LIMIT >> 20} MiB")
        submission = nbformat.read(real, as_version=4)
    except Exception as err:  # not JSON, not a notebook
        grade.error = f"UnreadableNotebook: {brief(str(err))}"
        return grade
    grade.lab, how = match_lab(submission, labs)
    if grade.lab is None:
        grade.error = f"NoLab: {how}"
        return grade
    instructor = labs[grade.lab]
    grade.submitted_at = os.path.getmtime(real)
    grade.version = lab_version(instructor)
    made_from = submitted_version(submission)
    if made_from and made_from != grade.version:
        grade.notes.append(f"made from version {made_from} of the lab, graded with version "
                           f"{grade.version}: its checks or points have changed since")
    if how != "lab id":
        grade.notes.append(f"matched by its {how}")
    prepared = prepare_submission(submission, instructor)
    grade.notes += prepared.notes
    try:
        tampered, static = static_pass(submission, instructor)
    except Unanalysable as err:        # costs this notebook: every exercise 0
        grade.error = f"Unanalysable: {err}"
        grade.exercises = [ExerciseScore(gid, 0.0, float(nbgrader_meta(c)["points"]),
                                         "Unanalysable", str(err), title=titles(instructor)[gid])
                           for gid, c in graded_cells(instructor).items()]
        grade.seconds = round(monotonic() - start, 2)
        return grade
    grade.tampering = [f"{where}: {what}" for where, what, _ in tampered]
    zeroed = set(static) | {gid for _, _, gids in tampered for gid in gids}
    settled = {i for i, gid in prepared.graded.items() if gid in zeroed}
    run = None                 # every check settled by the static pass: no kernel to start
    try:
        if settled != set(prepared.graded):
            run = run_prepared(prepared, instructor, box, limits or Limits(), timeout,
                               total_timeout, settled, pool)
    except Exception as err:
        grade.error = f"GraderError: {brief(str(err))}"
    where, named = {gid: i for i, gid in prepared.graded.items()}, titles(instructor)
    try:
        attempts = attempts_of(prepared, instructor)
    except (RecursionError, MemoryError, ValueError):   # an explanation, never a cost
        attempts = {}
    raised = exercise_errors(prepared, instructor, run)
    for gid, cell in graded_cells(instructor).items():
        found = evidence(gid, cell, where.get(gid), prepared, tampered, static, run)
        attempt = attempts.get(gid) or raised.get(gid)  # a syntax error elsewhere explains a NameError only
        if attempt and (attempt[2] or found.error == "NameError"):
            found.attempt = attempt[:2]
        grade.exercises.append(score(gid, float(nbgrader_meta(cell)["points"]), found,
                                     observed_of(cell)))
        grade.exercises[-1].title = named.get(gid, gid)
        if run is not None and where.get(gid) in run.threads:
            grade.notes.append(threads_note(grade.exercises[-1].title, *run.threads[where[gid]]))
    grade.seconds = round(monotonic() - start, 2)
    return grade


def threads_note(title: str, running: int, names) -> str:
    """The note for a check whose probe ended while threads the learner started still ran
    (their later changes were not seen: the probe's results are saved at its end)."""
    shown = f" ({', '.join(names)}{', ...' if running > len(names) else ''})" if names else ""
    who = f"{running} threads your code started{shown} were" if running > 1 else \
        f"a thread your code started{shown} was"
    return (f"{title}: {who} still running when the check's probe ended; what changed after "
            "that was not seen (the check judged the probe's results as they were then)")


def attempts_of(prepared, instructor) -> dict:
    """``{graded grade_id: (error, message, in its own exercise cell)}`` where the
    learner's cells say why its check fails: its exercise cell is the lab's stub
    ("NotAttempted"), or it (else an earlier cell of the learner's) is not valid Python."""
    from ..notebook.notebooks import strip_solution
    stubs = {nbgrader_meta(c).get("grade_id"): strip_solution(c.source)
             for c in instructor.cells if nbgrader_meta(c).get("solution") and c.cell_type == "code"}
    exercise, out, broken = exercise_of(instructor), {}, None
    cells = {}                                   # exercise grade_id -> (cell, its index)
    for i, cell in enumerate(prepared.nb.cells):
        if cell.cell_type != "code" or prepared.origin[i] is None:
            continue
        gid = nbgrader_meta(cell).get("grade_id")
        if i in prepared.graded:
            ex = exercise.get(prepared.graded[i])
            mine = cells.get(ex)
            problem = syntax_error(mine[0].source) if mine is not None else None
            if mine is not None and ex in stubs and untouched(mine[0].source, stubs[ex]):
                out[prepared.graded[i]] = ("NotAttempted", f"your cell {mine[1]} is as the lab "
                                           "gave it", True)
            elif problem:
                out[prepared.graded[i]] = ("SyntaxError", f"cell {mine[1]} (your code) is not "
                                           f"valid Python: {problem[1]}, line {problem[0]}", True)
            elif broken is not None:
                out[prepared.graded[i]] = ("SyntaxError", broken, False)
            continue
        if gid:
            cells[gid] = (cell, prepared.origin[i])
        problem = syntax_error(cell.source) if broken is None else None
        if problem:
            broken = (f"cell {prepared.origin[i]} (your code) is not valid Python: "
                      f"{problem[1]}, line {problem[0]}; what it defines is missing")
    return out


def exercise_errors(prepared, instructor, run) -> dict:
    """``{graded grade_id: (error, message, True)}`` where the learner's own exercise cell for
    that check raised when it ran: the check's failure (a ``NameError``, a rank's error in its
    probe) follows from it, so the report names the exercise cell's error (its type, cell and
    line: :func:`~mgpu_lab.course.grading.scoring.kernel_error`), not the probe's."""
    if run is None:
        return {}
    exercise, mine = exercise_of(instructor), {}
    for i, cell in enumerate(prepared.nb.cells):
        gid = nbgrader_meta(cell).get("grade_id")
        result = run.results.get(i)
        if (cell.cell_type == "code" and i not in prepared.graded and prepared.origin[i] is not None
                and gid and result is not None and result.error):
            error, message = kernel_error(result.error, result.message, result.frames,
                                          _learners_cells(prepared), (i, 0), ())
            mine[gid] = (error, f"your exercise cell raised it when it ran ({message}); "
                                "the check ran after it", True)
    return {g: mine[ex] for g, ex in exercise.items() if ex in mine}


def evidence(gid, cell, index, prepared, tampered, static, run) -> Evidence:
    """What the static pass and the run say about graded cell ``gid`` (at ``index``), in
    words a report may show (:func:`~mgpu_lab.course.grading.scoring.kernel_error`)."""
    if gid in prepared.missing:
        return Evidence(missing=True)
    found = Evidence(tampering=[f"{w}: {what}" for w, what, gids in tampered if gid in gids])
    result = run.results.get(index) if run is not None else None
    forbidden = forbidden_of(cell)
    found.calls = (static.get(gid) or (run.violations.get(index) if run else None)
                   or called_in(result.message if result else "", forbidden))
    if result is None:
        found.error, found.message = kernel_error("NotRun", "", [], {}, (index, 0), ())
    elif result.error:
        probe = graded_cell.split(cell.source).probe
        found.error, found.message = kernel_error(
            result.error, result.message, result.frames, _learners_cells(prepared),
            (index, cell.source.count("\n") + 1), _names_read(probe), hidden_lines(cell.source),
            run.memory_mib)
    verdict = run.verdicts.get(index) if run is not None else None
    if verdict is not None:
        found.judged = True
        line = visible_line(cell.source, verdict.line)     # as the learner's copy numbers it
        found.verdict, found.verdict_message = verdict_text(verdict.error, verdict.message, line)
        if verdict.error and verdict.misconception:
            found.hint = misconception_hint(cell, verdict.misconception)
            found.misconception = verdict.misconception if found.hint else None
        if verdict.error and not found.hint and verdict.differs:
            found.hint = verdict.differs       # the judge's words: no hidden case's place or value
        if verdict.error == "AssertionError" and verdict.line and shows_hidden(cell.source,
                                                                               verdict.line):
            found.verdict_message = f"check line {line} failed ({WITHHELD})"
        killed = result is not None and not result.error and result.message == OOM_MESSAGE
        if found.verdict and killed:   # a process the probe started (a rank, a script) was
            found.error, found.message = kernel_error(     # killed for memory: say so
                "OutOfMemory", "", [], {}, (index, 0), (), memory_mib=run.memory_mib)
    return found


def _learners_cells(prepared) -> dict:
    """``{cell index: (index in the learner's notebook, lines)}`` of the learner's code cells."""
    return {i: (prepared.origin[i], c.source.count("\n") + 1)
            for i, c in enumerate(prepared.nb.cells)
            if c.cell_type == "code" and i not in prepared.graded and prepared.origin[i] is not None}


def _names_read(source: str) -> set:
    tree = parse(source)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree else set()
