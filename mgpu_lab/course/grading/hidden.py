"""What feedback may say about a check that failed in a graded cell's hidden tests.

A graded cell's lines between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` are
the instructor's: the learner never sees them, so feedback never shows their inputs, their
expected values or their line numbers. A failed hidden ``assert`` is named by its place
among the cell's hidden asserts ("hidden check 2 of this cell failed") and keeps its
message only when that is a plain string literal (the instructor's words; an f-string,
a ``%`` or a name may format the case's values); any other exception raised there, or an
assertion raised by a helper a hidden line called, is named by its kind only. A visible
check may show its own line and message (``docs/AUTHORING.md`` has the rule for authors),
unless that message formats a value the hidden lines fed (:func:`shows_hidden`: a visible
``f"mul gave {mine}"`` where hidden inputs extend ``cases`` and the probe maps it to
``mine``), which is withheld.

The judge applies :func:`failure`; the grader :func:`shows_hidden` (it has the whole cell)
and :func:`hidden_lines` for the probe's errors (:mod:`.scoring`).
"""
from __future__ import annotations

import ast
from typing import List, Optional, Set, Tuple

from ..notebook.cells import parse, statements
from ..notebook.notebooks import BEGIN_HIDDEN, END_HIDDEN
from .scoring import RAISED_HIDDEN

RAISED = RAISED_HIDDEN
WITHHELD = "its message is withheld: it would show hidden cases"


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


def visible_line(source: str, line: Optional[int]) -> Optional[int]:
    """Line ``line`` of the instructor's cell as the learner's copy numbers it (hidden
    regions and their markers are not in the lab); None for None or a hidden line."""
    if not line:
        return line
    hidden = hidden_lines(source)
    return None if line in hidden else line - sum(1 for h in hidden if h < line)


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


def _targets(stmt: ast.stmt) -> Set[str]:
    """Names bound as loop or comprehension targets in a statement (what it reads of them
    it bound itself; a comprehension's stay in its own scope)."""
    out = set()
    for node in ast.walk(stmt):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            out |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return out


def _changed(stmt: ast.stmt, local: Set[str]) -> Set[str]:
    """Names a statement binds or changes in place: targets (``x``, ``x[i]``, ``x.a``,
    ``x += ...``, loop and ``with`` targets) and receivers of method calls (``x.append(...)``)
    among ``local``, the names the cell binds (``torch.manual_seed(0)`` changes no ``torch``)."""
    inner = {id(n) for c in ast.walk(stmt) if isinstance(c, ast.comprehension)
             for n in ast.walk(c.target)}
    out = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and id(node) not in inner:
            out.add(node.id)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            base = node
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                out.add(base.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in local:
            out.add(node.func.value.id)
    return out


def _read(node) -> Set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _feeding(tree, hidden: Set[int]):
    """``(statement, names fed after it)`` of a cell read top to bottom, one top-level
    statement at a time: a statement with a hidden line, or one that reads a fed name,
    feeds every name it binds or changes; any other rebinds its names clean."""
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    fed: Set[str] = set()
    for stmt in statements(tree):
        end = stmt.end_lineno or stmt.lineno
        if hidden & set(range(stmt.lineno, end + 1)) or (_read(stmt) - _targets(stmt)) & fed:
            fed = fed | _changed(stmt, local)
        else:
            fed = fed - {n.id for n in ast.walk(stmt)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        yield stmt, fed


def shows_hidden(source: str, line: int) -> bool:
    """Does the message of the visible ``assert`` at ``line`` of the graded cell ``source``
    format a name whose value the hidden lines fed at that point (:func:`_feeding`)?"""
    tree, hidden = parse(source), hidden_lines(source)
    if tree is None or not hidden or line in hidden:
        return False
    for stmt, fed in _feeding(tree, hidden):
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            target = next((n for n in ast.walk(stmt) if isinstance(n, ast.Assert)
                           and n.lineno <= line <= (n.end_lineno or n.lineno)), None)
            return bool(target is not None and target.msg is not None
                        and literal(target.msg) is None and _read(target.msg) & fed)
    return False


def fed_names(source: str) -> Set[str]:
    """The names of the graded cell ``source`` that its hidden lines feed at any point
    (:func:`_feeding`): a visible result extended by hidden cases is one of them, and the
    feedback treats it as hidden (:func:`.misconceptions.first_difference`)."""
    tree, hidden = parse(source), hidden_lines(source)
    if tree is None or not hidden:
        return set()
    out: Set[str] = set()
    for _, fed in _feeding(tree, hidden):
        out |= fed
    return out


def read_on_hidden(source: str) -> Set[str]:
    """The names the hidden lines of the graded cell ``source`` read: a visible result a
    hidden check judges (lab 13's ``choice``, whose only check of its values is hidden) is
    one of them, and the feedback treats it as hidden: the solution's value there is what
    that hidden check expects (:func:`.misconceptions.first_difference`)."""
    tree, hidden = parse(source), hidden_lines(source)
    if tree is None or not hidden:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.lineno in hidden}
