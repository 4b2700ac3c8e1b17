"""Tampering, found by reading the learner's cells (in the grader, never run).

Since the judge decides out of the kernel's reach (:mod:`mgpu_lab.course.grading.judge`),
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
- setting aside the dispatch modes the checks observe through (``_disable_current_modes``,
  ``_pop_mode``, ``_pop_mode_temporarily``, ``torch._C._DisableTorchDispatch``,
  ``torch._C._unset_dispatch_mode``, ``torch._C._pop_torch_dispatch_stack``);
- what the guard and the instruments rest on: ``linecache``, a module loaded again from its file
  (``importlib.util.spec_from_file_location``, ``module_from_spec``, ``SourceFileLoader``), the
  dispatch mode stack (``_get_current_dispatch_mode_stack``), private names of ``mgpu_lab.measure``;
- frames, code objects and raw memory: ``sys._getframe``, ``inspect.currentframe``,
  ``f_back``/``f_globals``/``__code__``/``__globals__``, ``globals()``, ``vars()``, ``ctypes``,
  ``gc.get_objects``;
- an imported name's namespace (``vars(torch)``, ``torch.__dict__``) used for anything but
  reading an entry named in the code (``vars(torch)["equal"] = ...``, ``.update(...)``, kept
  in a name, ``vars(torch)["ten" + "sor_split"]``);
- rebinding a name a check's probe uses (``launch``, ``torch``, a helper the lab
  gives), or one that a helper the probe calls uses in turn: the probe would call the
  learner's stand-in instead of the real thing;
- a solution that reads a check's inputs (``batch``) as a global instead of
  taking them as arguments.

It is a list of patterns, not a proof: docs/INSTRUCTORS.md says what it does not catch.
"""
from __future__ import annotations

import ast
from collections import ChainMap
from typing import Dict, List, Mapping

from ..notebook import graded_cell
from ..notebook.cells import (exercise_of, given_sources, given_statements, graded_cells,
                              learners_lines, nbgrader_meta, parse, statements, walk)
from ..notebook.cells import dotted, import_aliases

ALLOWED_SETTINGS = ("torch.backends.",)
MAGICS = {"run_line_magic", "run_cell_magic", "system", "getoutput"}
GET_IPYTHON = {"get_ipython", "IPython.get_ipython", "IPython.core.getipython.get_ipython"}
RUNS_STRINGS = {"exec", "eval", "compile", "__import__", "importlib.import_module"}
FORBIDDEN_NAMES = {"sys.modules": "touches sys.modules", "__builtins__": "touches __builtins__",
                   "importlib.reload": "reloads a module", "sys._getframe": "reads frames",
                   "inspect.currentframe": "reads frames", "inspect.stack": "reads frames",
                   "gc.get_objects": "walks every object", "gc.get_referrers": "walks every object",
                   "ctypes": "uses ctypes (raw memory)", "globals": "reads globals()"}
# Setting aside the dispatch modes a check observes through (bytes held, collectives issued, threads).
FORBIDDEN_NAMES.update({name: "sets aside the dispatch modes the checks observe through" for name in (
    "torch.utils._python_dispatch._disable_current_modes", "torch.utils._python_dispatch._pop_mode",
    "torch.utils._python_dispatch._pop_mode_temporarily", "torch._C._DisableTorchDispatch",
    "torch._C._unset_dispatch_mode", "torch._C._pop_torch_dispatch_stack")})
# What the "must not call" guard and the measuring instruments rest on: the cells' source as linecache
# holds it (the guard reads it to tell the instructor's frames from the learner's), a second copy of a
# module loaded from its file (functions the guard never wrapped), and the instruments' private state.
FORBIDDEN_NAMES.update({"linecache": "touches linecache (the cells' source the guard reads)",
                        "importlib.util.spec_from_file_location": "loads a second copy of a module from its file",
                        "importlib.util.module_from_spec": "loads a second copy of a module from its file",
                        "importlib.machinery.SourceFileLoader": "loads a second copy of a module from its file",
                        "torch.utils._python_dispatch._get_current_dispatch_mode_stack":
                            "reaches the dispatch modes the checks observe through",
                        "torch.utils._python_dispatch._get_current_dispatch_mode":
                            "reaches the dispatch modes the checks observe through"})
INSTRUMENTS = "mgpu_lab.measure."
# Reading one entry of a module's namespace (``vars(m)[k]``, ``.get``, the views) is
# ``getattr`` by another name; anything else (a store, ``update``, a name holding it) can patch it.
NAMESPACE_READS = {"get", "items", "keys", "values"}
FRAME_ATTRS = {"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame",
               "__code__", "__globals__", "__closure__"}


def _imported(node, aliases: Mapping[str, str]):
    """The dotted name of ``node`` when its root is an imported name, else None."""
    root = node
    while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
        root = root.func if isinstance(root, ast.Call) else root.value
    if not (isinstance(root, ast.Name) and root.id in aliases):
        return None
    return dotted(node, aliases) or aliases[root.id]


def _namespace_of(node, aliases: Mapping[str, str]):
    """The imported name whose namespace ``node`` is (``vars(torch)``, ``torch.__dict__``), or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" \
            and len(node.args) == 1:
        return _imported(node.args[0], aliases)
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return _imported(node.value, aliases)
    return None


def _reads_one_entry(node, parent, grand) -> bool:
    """``node`` (a namespace) only read, by a name written out: ``ns["k"]`` loaded,
    ``ns.get("k")``, or its views (a computed key is ``getattr`` of a computed name)."""
    if isinstance(parent, ast.Subscript) and parent.value is node:
        return isinstance(parent.ctx, ast.Load) and isinstance(parent.slice, ast.Constant)
    if not (isinstance(parent, ast.Attribute) and parent.value is node and parent.attr in NAMESPACE_READS):
        return False
    if parent.attr != "get":
        return True
    return isinstance(grand, ast.Call) and bool(grand.args) and isinstance(grand.args[0], ast.Constant)


def findings(source: str, aliases: Mapping[str, str]) -> List[str]:
    """What in ``source`` tampers with the kernel, one short phrase each (empty: nothing)."""
    tree = parse(source)
    if tree is None:
        return []
    aliases = ChainMap(import_aliases([tree]), aliases)
    found = []

    def flag(node, what):
        found.append((getattr(node, "lineno", 0), what))

    def patched(target, node, verb):
        name = _imported(target, aliases)
        if name and not name.startswith(ALLOWED_SETTINGS):
            flag(node, f"{verb} {name}")

    parents = {id(n): p for n, p in walk(tree)}
    for node, parent in walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                        patched(sub, node, "replaces" if not isinstance(node, ast.Delete)
                                else "deletes")
        elif isinstance(node, ast.Call):
            func = dotted(node.func, aliases) or ""
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
                if not (isinstance(parent, ast.Attribute) and parent.attr in MAGICS):
                    flag(node, "reaches into IPython (get_ipython())")
        namespace = _namespace_of(node, aliases)
        if namespace and not _reads_one_entry(node, parent, parents.get(id(parent))):
            flag(node, f"takes {namespace}'s namespace (vars()/__dict__) for more than reading an entry "
                       "named in the code")
        if isinstance(node, ast.Call) and (dotted(node.func, aliases) or "") == "vars" and not node.args:
            flag(node, "reads vars()")
        if isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRS:
            flag(node, f"uses .{node.attr}")
        if isinstance(node, (ast.Name, ast.Attribute)) and not isinstance(parent, ast.Attribute):
            name = dotted(node, aliases) or ""
            for bad, what in FORBIDDEN_NAMES.items():
                if name == bad or name.startswith(bad + "."):
                    flag(node, what)
            if name.startswith(INSTRUMENTS) and any(part.startswith("_") and not part.startswith("__")
                                                    for part in name[len(INSTRUMENTS):].split(".")):
                flag(node, f"reaches into a measuring instrument's private state ({name})")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "ctypes" for m in mods):
                flag(node, FORBIDDEN_NAMES["ctypes"])
    return list(dict.fromkeys(f"line {line}: {what}" for line, what in sorted(found)))


# --- a whole submission -------------------------------------------------------

def _probe_uses(probe: str) -> set:
    """The names a probe part reads from the kernel's namespace."""
    import builtins
    tree = ast.parse(probe)
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    return loads - bound - set(dir(builtins))


def _global_reads(tree) -> set:
    """Names a parsed cell reads without binding them itself, in any scope."""
    import symtable
    if tree is None:
        return set()
    try:
        top = symtable.symtable(ast.unparse(tree), "<cell>", "exec")
    except (SyntaxError, RecursionError):
        return set()
    out, scopes = set(), [top]
    while scopes:
        scope = scopes.pop()
        scopes += scope.get_children()
        for sym in scope.get_symbols():
            if scope is top:
                if sym.is_referenced() and not (sym.is_assigned() or sym.is_imported()):
                    out.add(sym.get_name())
            elif sym.is_global() and sym.is_referenced():
                out.add(sym.get_name())
    return out


def _given_reads(instructor) -> Dict[str, set]:
    """For each function and class the lab's given cells define, the global names its code reads."""
    out: Dict[str, set] = {}
    for source in given_sources(instructor):
        tree = parse(source)
        for node in (tree.body if tree is not None else []):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = _global_reads(ast.Module(body=[node], type_ignores=[]))
    return out


def _with_what_they_call(names: set, reads: Mapping[str, set]) -> set:
    """``names`` and, through the lab's given functions among them, every global those read."""
    seen, todo = set(names), list(names)
    while todo:
        for name in reads.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def tampering(submission, instructor, given=None, check=lambda: None):
    """``[(where, what, grade_ids)]``: each finding in what the learner wrote (solution
    cells, and statements the lab did not give) with the graded cells it costs.

    A finding of :func:`findings` costs its exercise when it is in a solution cell,
    else the next exercise's below it (none: the notebook is marked, no exercise
    lost). Rebinding a name that a later check's probe uses costs that check; a
    solution that reads a check's inputs as globals costs its exercise. Linear in the
    notebook's size; ``check()`` is called as it goes (it raises when out of time).
    """
    tests, exercise = graded_cells(instructor), exercise_of(instructor)
    gids_of: Dict[str, list] = {}
    for gid, ex in exercise.items():
        gids_of.setdefault(ex, []).append(gid)
    parts = {gid: graded_cell.split(c.source) for gid, c in tests.items()}
    # a name the probe reads, or one a given helper it calls reads (run_dispatch's MatrixProducts)
    reads = _given_reads(instructor)
    uses = {gid: _with_what_they_call(_probe_uses(p.probe), reads) for gid, p in parts.items()}
    given_aliases = import_aliases(parse(s) for s in given_sources(instructor))
    answers = {n for c in instructor.cells if nbgrader_meta(c).get("solution")
               and c.cell_type == "code" for n in graded_cell.bound_names(c.source)}
    inputs = {n for p in parts.values() for n in graded_cell.bound_names(p.inputs)}
    inputs -= set(given_aliases) | answers
    given = given_statements(instructor) if given is None else given
    cells = submission.cells
    trees = [parse(c.source) if c.cell_type == "code" else None for c in cells]
    aliases = import_aliases(trees)
    # The exercises below each cell, in order, each once (a copied exercise cell counts once).
    below: List[List[str]] = [[] for _ in cells]
    seen: List[str] = []
    for pos in range(len(cells) - 1, -1, -1):
        below[pos] = seen
        gid = nbgrader_meta(cells[pos]).get("grade_id")
        if gid is not None and gid in gids_of and gid not in seen:
            seen = [gid] + seen
    out = []
    for pos, (cell, tree) in enumerate(zip(cells, trees)):
        check()
        meta = nbgrader_meta(cell)
        if cell.cell_type != "code" or meta.get("grade_id") in tests:
            continue
        own = meta.get("grade_id") if meta.get("solution") else None
        lines = learners_lines(tree, given, whole=bool(own))
        later = below[pos]
        costs = gids_of.get(own) or (gids_of[later[0]] if later else [])
        where = f"cell {pos}" + (f" ({own})" if own else "")
        for what in findings(cell.source, aliases):
            if int(what.split(":")[0].split()[1]) in lines:
                out.append((where, what, list(costs)))
        for stmt in statements(tree):
            if stmt.lineno not in lines:
                continue
            same = import_aliases([stmt]) if isinstance(stmt, (ast.Import, ast.ImportFrom)) else {}
            for name in graded_cell.names_bound(stmt):
                same_import = (isinstance(stmt, (ast.Import, ast.ImportFrom))
                               and same.get(name) == given_aliases.get(name))
                hit = [g for e in [own] + later for g in gids_of.get(e, []) if name in uses[g]]
                if hit and not same_import and name not in answers:
                    out.append((where, f"line {stmt.lineno}: rebinds `{name}`, which the checks "
                                       "use", hit))
        if own:
            for name in sorted(_global_reads(tree) & inputs):
                out.append((where, f"reads `{name}`, a name of a check's inputs, instead of its "
                                   "arguments", list(costs)))
    return out
