"""Tampering, found by reading the learner's cells (in the grader, never run).

Since the judge decides out of the kernel's reach (:mod:`mgpu_lab.course.judge`),
patching ``torch.equal`` no longer changes a verdict. It is still reported: it
is an attempt, and the checks that observe behaviour inside the kernel (threads,
bytes kept, collectives issued) and the "must not call" guard live there. What
this pass flags, in every code cell the learner wrote or edited:

- assigning or deleting an attribute of an imported module, class or function
  (``torch.equal = ...``, ``del mgpu_lab.scatter``, ``Tensor.add = ...``), and
  ``setattr``/``delattr`` on one (``torch.backends.*`` settings are allowed);
- ``sys.modules``, ``__builtins__``, ``importlib.reload``;
- IPython's machinery: anything on ``get_ipython()`` but running a magic
  (``set_custom_exc``, ``showtraceback``, ``events``, input transformers...);
- running built strings: ``exec``, ``eval``, ``compile``, ``__import__`` of a
  non-literal; ``getattr`` of a computed name on a module;
- frames, code objects and raw memory: ``sys._getframe``, ``inspect.currentframe``,
  ``f_back``/``f_globals``/``__code__``/``__globals__``, ``ctypes``, ``gc.get_objects``.

It is a list of patterns, not a proof: the README says what it does not catch.
"""
from __future__ import annotations

import ast
from typing import Dict, List

from .guard import _dotted, _parse, import_aliases

ALLOWED_SETTINGS = ("torch.backends.",)
MAGICS = {"run_line_magic", "run_cell_magic", "system", "getoutput"}
GET_IPYTHON = {"get_ipython", "IPython.get_ipython", "IPython.core.getipython.get_ipython"}
RUNS_STRINGS = {"exec", "eval", "compile", "__import__", "importlib.import_module"}
FORBIDDEN_NAMES = {"sys.modules": "touches sys.modules", "__builtins__": "touches __builtins__",
                   "importlib.reload": "reloads a module", "sys._getframe": "reads frames",
                   "inspect.currentframe": "reads frames", "inspect.stack": "reads frames",
                   "gc.get_objects": "walks every object", "gc.get_referrers": "walks every object",
                   "ctypes": "uses ctypes (raw memory)"}
FRAME_ATTRS = {"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame",
               "__code__", "__globals__", "__closure__"}


def _imported(node, aliases: Dict[str, str]):
    """The dotted name of ``node`` when its root is an imported name, else None."""
    root = node
    while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
        root = root.func if isinstance(root, ast.Call) else root.value
    if not (isinstance(root, ast.Name) and root.id in aliases):
        return None
    return _dotted(node, aliases) or aliases[root.id]


def findings(source: str, aliases: Dict[str, str]) -> List[str]:
    """What in ``source`` tampers with the kernel, one short phrase each (empty: nothing)."""
    tree = _parse(source)
    if tree is None:
        return []
    aliases = dict(aliases, **import_aliases([source]))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []

    def flag(node, what):
        found.append((getattr(node, "lineno", 0), what))

    def patched(target, node, verb):
        name = _imported(target, aliases)
        if name and not name.startswith(ALLOWED_SETTINGS):
            flag(node, f"{verb} {name}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                        patched(sub, node, "replaces" if not isinstance(node, ast.Delete)
                                else "deletes")
        elif isinstance(node, ast.Call):
            func = _dotted(node.func, aliases) or ""
            if func in ("setattr", "delattr") and node.args:
                patched(node.args[0], node, f"{func}() on")
            elif func in RUNS_STRINGS and not (
                    node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                flag(node, f"{func}() of a built string")
            elif func == "getattr" and len(node.args) >= 2 and _imported(node.args[0], aliases) \
                    and not isinstance(node.args[1], ast.Constant):
                flag(node, f"getattr() of a computed name on {_imported(node.args[0], aliases)}")
            elif func in GET_IPYTHON:
                parent = parents.get(node)
                if not (isinstance(parent, ast.Attribute) and parent.attr in MAGICS):
                    flag(node, "reaches into IPython (get_ipython())")
        if isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRS:
            flag(node, f"uses .{node.attr}")
        if isinstance(node, (ast.Name, ast.Attribute)) and not isinstance(
                parents.get(node), ast.Attribute):
            name = _dotted(node, aliases) or ""
            for bad, what in FORBIDDEN_NAMES.items():
                if name == bad or name.startswith(bad + "."):
                    flag(node, what)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "ctypes" for m in mods):
                flag(node, FORBIDDEN_NAMES["ctypes"])
    return list(dict.fromkeys(f"line {line}: {what}" for line, what in sorted(found)))


# --- a whole submission -------------------------------------------------------

def tampering(submission, instructor):
    """``[(where, what, grade_ids)]``: each finding of :func:`findings` in what the
    learner wrote (solution cells, and statements the lab did not give), with the
    graded cells it costs: its exercise's own when found in a solution cell, else
    the next exercise's below it (none: the notebook is marked, no exercise lost)."""
    from .notebooks import graded_cells, nbgrader_meta
    from .submission import exercise_of, given_statements, learners_lines
    tests, exercise = graded_cells(instructor), exercise_of(instructor)
    gids_of = {}
    for gid, ex in exercise.items():
        gids_of.setdefault(ex, []).append(gid)
    given, cells = given_statements(instructor), submission.cells
    aliases = import_aliases([c.source for c in cells if c.cell_type == "code"])
    out = []
    for pos, cell in enumerate(cells):
        meta = nbgrader_meta(cell)
        if cell.cell_type != "code" or meta.get("grade_id") in tests:
            continue
        own = meta.get("grade_id") if meta.get("solution") else None
        lines = learners_lines(cell.source, given, whole=bool(own))
        later = (nbgrader_meta(c).get("grade_id") for c in cells[pos + 1:]
                 if nbgrader_meta(c).get("solution"))
        costs = gids_of.get(own) or next((gids_of[e] for e in later if e in gids_of), [])
        where = f"cell {pos}" + (f" ({own})" if own else "")
        for what in findings(cell.source, aliases):
            if int(what.split(":")[0].split()[1]) in lines:
                out.append((where, what, list(costs)))
    return out
