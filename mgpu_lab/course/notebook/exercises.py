"""A lab's exercises as its notebook states them: titles, stated points, version, attempts.

- **Titles.** An exercise is announced by a markdown heading above it (``### Exercise 1
  (3 points): `rank_slice` ``); its title is that heading without the points
  (``Exercise 1: rank_slice``): the reports and the platforms' tests are named by it
  (:func:`titles`).
- **Stated points.** A heading that states points must state the graded cell's
  ``points`` (:func:`points_mismatches`; ``labs build`` refuses the notebook otherwise).
- **Messages.** Every ``assert`` of a graded cell, hidden ones included, carries a
  message: the report shows it, with the check's line (:func:`asserts_without_message`).
- **The lab version** (:func:`lab_version`): a hash of what the grader runs of the
  instructor's (graded cells with their points and metadata, setup cells). ``labs
  build`` writes it into each lab (``metadata.mgpu_lab.version``); a submission made
  from another version gets a note in its report.
- **Attempts** (:func:`untouched`, :func:`syntax_error`): an exercise cell left as the lab
  gave it, or one that is not valid Python, explains why its check failed.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from typing import Dict, List, Optional, Tuple

from .cells import (IPYTHON_LINES, course_meta, exercise_of, graded_cells, nbgrader_meta,
                    parse, setup_sources)

HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$")
POINTS = re.compile(r"(\d+(?:\.\d+)?(?:\s*\+\s*\d+(?:\.\d+)?)*)\s+points?\b", re.I)  # "3 points", "2 + 1 points"
PARENTHESES = re.compile(r"\s*\(([^()]*)\)")


def _headings(cell) -> List[str]:
    if cell.get("cell_type") != "markdown":
        return []
    found = (HEADING.match(line) for line in cell.get("source", "").splitlines())
    return [m.group(1) for m in found if m]


def exercise_headings(nb) -> Dict[str, str]:
    """``{graded grade_id: the heading that announces its exercise}``: the last heading
    naming an exercise between the previous graded cell and this one (else the last
    heading there; else, for a second graded cell of the same exercise, its first's)."""
    out, seen, previous = {}, [], (None, "")
    exercise = exercise_of(nb)
    for cell in nb.cells:
        seen += _headings(cell)
        meta = nbgrader_meta(cell)
        if meta.get("grade") and cell.get("cell_type") == "code" and "grade_id" in meta:
            gid = meta["grade_id"]
            named = [h for h in seen if "exercise" in h.lower()]
            same = exercise.get(gid) is not None and exercise.get(gid) == previous[0]
            out[gid] = (named or seen or [previous[1] if same else ""])[-1]
            previous, seen = (exercise.get(gid), out[gid]), []
    return out


def stated_points(heading: str) -> Optional[float]:
    """The points a heading states in parentheses (``(3 points)``, ``(design, 4 points)``)."""
    for group in PARENTHESES.finditer(heading):
        found = POINTS.search(group.group(1))
        if found:
            return sum(float(n) for n in found.group(1).split("+"))
    return None


def title(heading: str) -> str:
    """A heading as a title: without its points (other words in their parentheses stay)
    and without markdown's backticks and emphasis."""
    def drop_points(group):
        rest = [w.strip() for w in POINTS.sub("", group.group(1)).split(",") if w.strip()]
        return f" ({', '.join(rest)})" if rest else ""
    text = PARENTHESES.sub(lambda g: drop_points(g) if POINTS.search(g.group(1)) else g.group(0),
                           heading)
    text = re.sub(r"[`*]", "", text)
    return " ".join(text.replace(" :", ":").split())


def titles(nb) -> Dict[str, str]:
    """``{graded grade_id: its exercise's title}`` (where no heading names an exercise: the
    exercise cell's grade_id); an exercise graded by several cells titles each "(check k of
    n)", so that every line of a report or feedback file has its own title."""
    exercise = exercise_of(nb)
    named = {gid: title(h) if "exercise" in h.lower() else (exercise.get(gid) or gid)
             for gid, h in exercise_headings(nb).items()}
    shared = {t: [g for g in named if named[g] == t] for t in set(named.values())}
    return {gid: t if len(shared[t]) == 1 else f"{t} (check {shared[t].index(gid) + 1} of "
            f"{len(shared[t])})" for gid, t in named.items()}


def points_mismatches(nb) -> List[str]:
    """Where an exercise's heading states other points than its graded cells' metadata
    (summed over the exercise's graded cells: "(2 + 1 points)" for two)."""
    out, done = [], set()
    headings, exercise = exercise_headings(nb), exercise_of(nb)
    total: Dict[str, float] = {}
    for gid, cell in graded_cells(nb).items():
        key = exercise.get(gid) or gid
        total[key] = total.get(key, 0.0) + float(nbgrader_meta(cell).get("points", 0))
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        gid = meta.get("grade_id")
        key = exercise.get(gid) or gid
        if not (meta.get("grade") and gid in headings) or key in done:
            continue
        done.add(key)
        said = stated_points(headings[gid])
        if said is not None and said != total[key]:
            out.append(f"cell {index} ({gid}): its heading says {said:g} points, its exercise's graded "
                       f"cells {total[key]:g} ({headings[gid]!r})")
    return out


def asserts_without_message(nb) -> List[str]:
    """Every ``assert`` of a graded cell (hidden tests included) that has no message."""
    out = []
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        if not (meta.get("grade") and cell.get("cell_type") == "code"):
            continue
        tree = parse(cell.source)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Assert) and node.msg is None:
                out.append(f"cell {index} ({meta.get('grade_id')}): line {node.lineno}: an "
                           "assert without a message (the report would say nothing)")
    return out


def lab_version(nb) -> str:
    """A short hash of what the grader runs of the instructor's notebook: each graded cell
    (id, points, source, reimplements/observed; not the grader's ``expects``, ``free``,
    ``misconceptions`` and ``reference``, which the learner's notebook does not carry) and each setup cell."""
    parts = [[gid, nbgrader_meta(c).get("points"), c.source,
              {k: v for k, v in course_meta(c).items()
               if k not in ("expects", "free", "misconceptions", "reference", "several")}]
             for gid, c in graded_cells(nb).items()] + setup_sources(nb)
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def submitted_version(nb) -> Optional[str]:
    """The lab version a learner's notebook was made from (None: not recorded)."""
    value = (nb.get("metadata", {}).get("mgpu_lab") or {}).get("version")
    return value if isinstance(value, str) and value else None


def untouched(source: str, given: str) -> bool:
    """Is an exercise cell's ``source`` the lab's ``given`` stub (comments and blank lines
    aside)?"""
    if source.strip() == given.strip():
        return True
    a, b = parse(source), parse(given)
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def syntax_error(source: str) -> Optional[Tuple[int, str]]:
    """``(line, what)`` when a cell is not valid Python, even read as IPython syntax."""
    if parse(source) is not None:
        return None
    python = source
    magics = sum(1 for line in source.splitlines() if line.lstrip()[:1] in ("%", "!"))
    if magics <= IPYTHON_LINES:          # IPython's transformer is quadratic in them
        try:
            from IPython.core.inputtransformer2 import TransformerManager
            python = TransformerManager().transform_cell(source)
        except Exception:
            python = source
    try:
        ast.parse(python)
    except SyntaxError as err:
        return int(err.lineno or 1), str(err.msg or "invalid syntax")[:120]
    except (ValueError, RecursionError, MemoryError) as err:
        return 1, type(err).__name__
    return 1, "invalid syntax"
