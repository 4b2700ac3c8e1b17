"""A lab notebook's cells, as the course reads them (both sides of grading use this).

A lab marks its cells with nbgrader-style metadata and a few tags:

- an **exercise** (solution) cell: ``nbgrader: {grade_id, solution: true}``;
- a **graded** cell: ``nbgrader: {grade_id, grade: true, points}``; the exercise it
  checks is the nearest solution cell above it (:func:`exercise_of`);
- **given** cells: every other code cell (the instructor's code the learner runs);
- tags ``setup`` (also run in the grader's judge process), ``demo`` (not run when
  graded), ``answer-key`` (kept in the solution only);
- the lab id, ``metadata.mgpu_lab.lab``, and per graded cell ``metadata.mgpu_lab``
  (``reimplements``: what it must not call, ``observed``: what it observes in the kernel).

Cells are parsed as the kernel runs them: IPython syntax (``%matplotlib inline``,
``!ls``) is turned into Python first (:func:`parse`).
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set

SETUP_TAG = "setup"          # also runs in the grader's judge process, before the checks
DEMO_TAG = "demo"            # shows something; defines nothing a check needs: not run when graded
ANSWER_KEY_TAG = "answer-key"


@functools.lru_cache(maxsize=4096)
def parse(source: str) -> Optional[ast.Module]:
    """The syntax tree of a cell as the kernel runs it (IPython syntax turned into Python
    first); None when it is not valid Python (or too deeply nested to parse).

    Cached: every pass over a submission reads the same trees (never change one).
    IPython's own transformer re-reads the whole cell once per magic (quadratic, and it
    gives up past 500); a cell with more than :data:`IPYTHON_LINES` such lines is
    turned into Python here, line by line, as IPython would call each magic.
    """
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pass
    escapes = sum(1 for line in source.splitlines() if _ESCAPE.match(line))
    python = None
    if escapes <= IPYTHON_LINES:
        try:
            from IPython.core.inputtransformer2 import TransformerManager
            python = TransformerManager().transform_cell(source)
        except Exception:   # no IPython, or a transformer that chokes on odd input
            python = None
    if python is None:
        python = _plain_python(source)
    try:
        return ast.parse(python)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


IPYTHON_LINES = 50
_ESCAPE = re.compile(r"^\s*[%!?]|^\s*\w+\s*=\s*[%!]")
_ASSIGNED = re.compile(r"^(\s*)(\w+)\s*=\s*[%!]")


def _plain_python(source: str) -> str:
    """IPython syntax as the calls it makes: ``%m args`` and ``!cmd`` lines become
    ``get_ipython().run_line_magic(...)`` / ``.system(...)``, ``x = !cmd`` an assignment of
    ``get_ipython().getoutput(...)``, a ``%%`` cell one ``run_cell_magic`` call."""
    if source.lstrip().startswith("%%"):
        return "get_ipython().run_cell_magic('', '', '')"
    out = []
    for line in source.splitlines():
        assigned = _ASSIGNED.match(line)
        if assigned:
            out.append(f"{assigned.group(1)}{assigned.group(2)} = get_ipython().getoutput('')")
        elif _ESCAPE.match(line):
            indent = line[: len(line) - len(line.lstrip())]
            call = "system" if line.lstrip().startswith("!") else "run_line_magic"
            out.append(f"{indent}get_ipython().{call}('', '')")
        else:
            out.append(line)
    return "\n".join(out)


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def course_meta(cell) -> dict:
    """A cell's ``metadata.mgpu_lab`` (``reimplements``, ``observed``)."""
    return cell.get("metadata", {}).get("mgpu_lab") or {}


def tags(cell) -> List[str]:
    return list(cell.get("metadata", {}).get("tags", []) or [])


def lab_id(nb) -> Optional[str]:
    """The lab a notebook belongs to (``metadata.mgpu_lab.lab``), or None."""
    value = (nb.get("metadata", {}).get("mgpu_lab") or {}).get("lab")
    return value if isinstance(value, str) and value else None


def is_graded(cell) -> bool:
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade")) and cell.get("cell_type") == "code" and "grade_id" in meta


def is_given(cell) -> bool:
    """A code cell of the instructor's that is neither an exercise nor graded."""
    meta = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and not meta.get("solution") and not meta.get("grade")


def graded_cells(nb) -> dict:
    """``{grade_id: cell}`` for every graded test cell, in notebook order."""
    return {nbgrader_meta(c)["grade_id"]: c for c in nb.cells
            if nbgrader_meta(c).get("grade") and "grade_id" in nbgrader_meta(c)}


def exercise_of(instructor) -> Dict[str, Optional[str]]:
    """``{graded grade_id: grade_id of the nearest solution cell above it}``."""
    out, last = {}, None
    for cell in instructor.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            last = meta.get("grade_id")
        if meta.get("grade") and cell.cell_type == "code" and "grade_id" in meta:
            out[meta["grade_id"]] = last
    return out


def observed_of(cell) -> str:
    """What a graded cell observes inside the learner's kernel (its metadata says):
    such a check is not tamper-proof, and the report says so."""
    return str(course_meta(cell).get("observed") or "")


def setup_sources(instructor) -> List[str]:
    """The instructor's cells tagged ``setup``: they run in the judge before any check."""
    return [c.source for c in instructor.cells if c.cell_type == "code" and SETUP_TAG in tags(c)]


def given_sources(instructor) -> List[str]:
    """The sources of the instructor's given code cells."""
    return [c.source for c in instructor.cells if is_given(c)]


def given_statements(instructor) -> Set[str]:
    """Every top-level statement of the lab's given code cells, as ``ast.unparse`` writes it
    (the lab shows given cells as they are: markers live only in exercise and graded cells)."""
    out: Set[str] = set()
    for source in given_sources(instructor):
        tree = parse(source)
        out.update(ast.unparse(s) for s in (tree.body if tree else []))
    return out


def statements(tree: Optional[ast.Module]) -> List[ast.stmt]:
    return list(tree.body) if tree is not None else []


def learners_lines(tree: Optional[ast.Module], given: Set[str], whole: bool = False) -> Set[int]:
    """Line numbers of a cell (its parsed ``tree``) that the learner wrote: in statements
    the lab did not give (every line, ``whole``, for a solution cell)."""
    lines: Set[int] = set()
    for stmt in statements(tree):
        if whole or _unparse(stmt) not in given:
            lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _unparse(node) -> str:
    try:
        return ast.unparse(node)
    except RecursionError:        # too deep to write back: never a given statement
        return ""


# --- names in a parsed cell (the static passes read them) ---------------------
#
# Every pass reads a cell's tree once: :func:`scan` walks it (no recursion: any depth)
# and keeps what the passes need on the node itself, so that a large submission costs
# a few walks, not one per question asked of it.

_AST = ast.AST


def walk(node) -> Iterable[tuple]:
    """``(node, parent)`` for every node under ``node`` (itself with parent None), depth
    first, iteratively; faster than :func:`ast.walk`."""
    todo = [(node, None)]
    while todo:
        n, parent = todo.pop()
        yield n, parent
        for field in n._fields:
            value = getattr(n, field, None)
            if isinstance(value, list):
                todo.extend((v, n) for v in reversed(value) if isinstance(v, _AST))
            elif isinstance(value, _AST):
                todo.append((value, n))


@dataclass
class Scan:
    names: Set[str]                  # every ast.Name's id
    heads: List[ast.AST]             # the outermost node of every chain of names
    attributes: Set[str]             # every attribute name
    imports: List[ast.stmt]          # import statements, in source order


def scan(node) -> Scan:
    """What the static passes read of a parsed cell or statement (one walk, kept on it)."""
    done = getattr(node, "_course_scan", None)
    if done is not None:
        return done
    names, attributes, inner, imports, order = set(), set(), set(), [], []
    for n, _ in walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
            order.append(n)
        elif isinstance(n, ast.Attribute):
            attributes.add(n.attr)
            inner.add(id(n.value))
            order.append(n)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            imports.append(n)
        elif isinstance(n, ast.Call):
            pair = literal_getattr(n)
            if pair is not None:
                inner.add(id(pair[0]))
                order.append(n)
    imports.sort(key=lambda n: (n.lineno, n.col_offset))
    done = Scan(names, [n for n in order if id(n) not in inner], attributes, imports)
    try:
        node._course_scan = done
    except AttributeError:
        pass
    return done


def import_aliases(trees: Iterable[Optional[ast.Module]]) -> Dict[str, str]:
    """``{local name: dotted name}`` from every import statement in ``trees``."""
    aliases: Dict[str, str] = {}
    for tree in trees:
        for node in scan(tree).imports if tree is not None else ():
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        aliases[root] = root
            elif node.module and not node.level:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def literal_getattr(node):
    """``(obj, "name")`` for ``getattr(obj, "name")``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[0], node.args[1].value
    return None


def dotted_parts(node, aliases: Mapping[str, str]) -> Optional[List[str]]:
    """``["torch", "nn", "parallel", "scatter"]`` for that chain of names (``getattr(x,
    "y")`` read as ``x.y``), the first name resolved through the import aliases; None for
    other nodes."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
            continue
        pair = literal_getattr(node)
        if pair is None:
            break
        node, attr = pair
        parts.append(attr)
    if not isinstance(node, ast.Name):
        return None
    parts.extend(reversed(aliases.get(node.id, node.id).split(".")))
    parts.reverse()
    return parts


def dotted(node, aliases: Mapping[str, str]) -> Optional[str]:
    """The dotted name of ``node`` (see :func:`dotted_parts`), or None."""
    parts = dotted_parts(node, aliases)
    return ".".join(parts) if parts is not None else None
