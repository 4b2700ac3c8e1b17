"""What feedback may say about a check that failed in a graded cell's hidden tests.

A graded cell's lines between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` are
the instructor's: the learner never sees them, so feedback never shows their inputs, their
expected values or their line numbers. A failed hidden ``assert`` is named by its place
among the cell's hidden asserts ("hidden check 2 of this cell failed") and keeps its
message only when that is a plain string literal (the instructor's words; an f-string,
a ``%`` or a name may format the case's values); any other exception raised there, or an
assertion raised by a helper a hidden line called, is named by its kind only. A visible
check may show its own line and message (``docs/AUTHORING.md`` has the rule for authors).

The judge applies it (:func:`failure`); the runner's probe errors are placed with
:func:`hidden_lines` (:mod:`.scoring`).
"""
from __future__ import annotations

import ast
from typing import List, Optional, Set, Tuple

from ..notebook.cells import parse
from ..notebook.notebooks import BEGIN_HIDDEN, END_HIDDEN
from .scoring import RAISED_HIDDEN

RAISED = RAISED_HIDDEN


def hidden_lines(source: str) -> Set[int]:
    """Line numbers (1-based) of ``source`` inside hidden regions, their markers included."""
    lines, inside = set(), False
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if text.startswith(BEGIN_HIDDEN):
            inside = True
        if inside:
            lines.add(number)
        if text.startswith(END_HIDDEN):
            inside = False
    return lines


def hidden_asserts(source: str) -> List[ast.Assert]:
    """The ``assert`` statements that start on hidden lines, in the order of the source."""
    tree, hidden = parse(source), hidden_lines(source)
    if tree is None:
        return []
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.lineno in hidden]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def literal(node: Optional[ast.expr]) -> Optional[str]:
    """The text of a plain string literal, else None."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def failure(source: str, kind: str, line: Optional[int], raised_here: bool) -> Optional[Tuple[str, str]]:
    """``(kind, message)`` a verdict may carry for a failure at ``line`` of the judge part
    ``source`` when that line is hidden (its line is then never reported); None when the
    line is visible. ``raised_here``: the exception was raised by the judge part's own code
    (not by a helper it called)."""
    if line is None or line not in hidden_lines(source):
        return None
    if kind != "AssertionError":
        return kind, RAISED
    for number, node in enumerate(hidden_asserts(source), 1):
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            words = literal(node.msg) if raised_here else None
            said = f": {words}" if words else ""
            return kind, f"hidden check {number} of this cell failed{said}"
    return kind, RAISED
