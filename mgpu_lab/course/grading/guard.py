""""This exercise must not call X": every part of it, on both sides of grading.

A courtesy, not a defence. It tells a learner who called the reference an exercise
re-implements that the exercise is about writing it; a score never rests on it. The
static half reads only patterns, and the run-time half lives in the learner's own
process, where code that is not a notebook cell (``exec`` of a string, a thread, a
module written to disk) or the guard's own state can reach past it. What a score rests
on is the judge's verdict on data only a working implementation produces
(:mod:`mgpu_lab.course.grading.judge`, docs/INSTRUCTORS.md's "A score is evidence").

A from-scratch exercise declares, on the instructor's graded cell, the references it
re-implements::

    "mgpu_lab": {"reimplements": ["mgpu_lab.scatter", "torch.nn.parallel.scatter"]}

The learner's solution cell for a graded cell is the nearest solution cell above it.
Two checks:

- **static**, in the grader (:func:`notebook_violations`): the solution cell names a
  reference (import aliases from any cell resolved, ``getattr(x, "name")`` read as
  ``x.name``), or reaches one through a name that a statement of the learner's in a cell
  above binds (an alias, a helper, an import), directly or through other such names. A
  name is matched against what the grader has already loaded (:class:`References`):
  nothing a submission names is ever imported, and the pass is linear in its size.
  ``torch.Tensor.m`` matches any ``.m`` attribute (a method call on a tensor).
- **at run time**, in the kernel, while the graded cell runs (:func:`install`): each
  reference is replaced (module attributes, the learner's globals, a Python function's
  code, a class's ``__init__``, a ``torch.Tensor`` method) by a guard that raises
  :class:`ForbiddenCall` when the nearest notebook-cell frame calling it is not the
  instructor's; restored after the cell. Ranks forked by ``launch()`` inherit it. The
  runner installs it with :func:`install_code` and reads it back with
  :func:`read_violations`.
"""
from __future__ import annotations

import ast
import importlib
import re
import sys
import types
from collections import ChainMap
from typing import Dict, Iterable, List, Mapping, Optional, Set

from ..notebook.cells import course_meta, dotted_parts, import_aliases, scan

MESSAGE = "this exercise must not call {}"
CALLED = re.compile(MESSAGE.format(r"([\w.]+)"))
_KERNEL_FILE = re.compile(r"ipykernel_\d+[/\\]-?\d+\.py$")
MAX_PARTS = 12          # a dotted name longer than this is never a reference's spelling


class ForbiddenCall(RuntimeError):
    """A from-scratch exercise called the reference it re-implements."""


def forbidden_of(cell) -> List[str]:
    """The references a graded cell's exercise must not call (its metadata)."""
    return [str(f) for f in course_meta(cell).get("reimplements") or []]


def message(calls: Iterable[str]) -> str:
    return MESSAGE.format(", ".join(calls))


def called_in(text: str, forbidden: Iterable[str]) -> List[str]:
    """The references of ``forbidden`` that a failure's text reports as called (a rank
    that ``launch()`` forked raised :class:`ForbiddenCall`); never a name outside it."""
    allowed = set(forbidden)
    return sorted({m.group(1) for m in CALLED.finditer(text or "")} & allowed)


# --- the references, resolved without importing what a submission names ---------

def _resolve(name: str):
    """The object an instructor's dotted name names (importing its modules), or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _own(obj, attr: str):
    """``obj.attr`` from the dictionaries of a module or a class (and its bases), or None:
    no ``__getattr__``, property or import runs."""
    if isinstance(obj, types.ModuleType):
        return vars(obj).get(attr)
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if attr in vars(klass):
                return vars(klass)[attr]
    return None


class References:
    """The references of a "must not call" list, resolved once in the grader (the
    instructor's names: importing them is safe). A learner's dotted name is then matched
    by looking it up among modules already loaded, attribute by attribute, in their own
    dictionaries: nothing it names is imported or run, whatever it is."""

    def __init__(self, forbidden: Iterable[str]):
        self.names = list(dict.fromkeys(forbidden))
        self.objects: Dict[int, tuple] = {}      # id -> (object, name): the object kept alive
        for name in self.names:
            obj = _resolve(name)
            if obj is not None:
                self.objects[id(obj)] = (obj, name)
        self.methods = {n.rsplit(".", 1)[1]: n for n in self.names if n.startswith("torch.Tensor.")}

    def _named(self, obj) -> Optional[str]:
        hit = self.objects.get(id(obj))
        return hit[1] if hit is not None and hit[0] is obj else None

    def match(self, parts: List[str]) -> Optional[str]:
        """The reference a chain of names (or one of its prefixes) is, or None; in time
        linear in the chain's length."""
        for cut in range(1, min(len(parts), MAX_PARTS) + 1):
            name = ".".join(parts[:cut])
            if name in self.names:
                return name
        obj = sys.modules.get(parts[0])
        for cut in range(1, len(parts)):
            if obj is None:
                return None
            found = _own(obj, parts[cut])
            if found is None and isinstance(obj, types.ModuleType) and cut < MAX_PARTS:
                found = sys.modules.get(".".join(parts[: cut + 1]))   # a submodule not bound
            obj = found
            if obj is not None and self._named(obj):
                return self._named(obj)
        return None

    def in_tree(self, tree, aliases: Mapping[str, str]) -> Set[str]:
        """The references a parsed cell (or statement) names."""
        found: Set[str] = set()
        if tree is None:
            return found
        read = scan(tree)
        found.update(self.methods[a] for a in read.attributes & set(self.methods))
        for node in read.heads:
            parts = dotted_parts(node, aliases)
            if parts is not None:
                hit = self.match(parts)
                if hit:
                    found.add(hit)
        return found


_REFERENCES: Dict[tuple, References] = {}


def references(forbidden: Iterable[str]) -> References:
    """:class:`References` of a list, made once per list in this process."""
    key = tuple(forbidden)
    if key not in _REFERENCES:
        _REFERENCES[key] = References(key)
    return _REFERENCES[key]


def static_violations(source: str, forbidden: List[str], aliases: Mapping[str, str]) -> List[str]:
    """The forbidden references that ``source`` names (empty when none)."""
    from ..notebook.cells import parse
    tree = parse(source)
    own = import_aliases([tree])
    return sorted(references(forbidden).in_tree(tree, ChainMap(own, aliases)))


# --- a whole notebook (grader side) ---------------------------------------------

BINDS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.FunctionDef, ast.AsyncFunctionDef,
         ast.ClassDef, ast.Import, ast.ImportFrom)


def _loaded(node) -> Set[str]:
    return scan(node).names if node is not None else set()


def notebook_violations(student, instructor, given: Optional[Set[str]] = None,
                        check=lambda: None) -> Dict[str, List[str]]:
    """``{graded grade_id: forbidden references}`` that its solution cell names, or reaches
    through a name that a statement of the learner's in a cell above binds to one (an
    alias, a helper, an import: a way round the check from elsewhere), directly or through
    other such names. Linear in the notebook's size; ``check()`` is called as it goes
    (it raises when the static pass is out of time)."""
    from ..notebook.cells import (exercise_of, given_statements, graded_cells, learners_lines,
                                  nbgrader_meta, parse, statements)
    from ..notebook.graded_cell import names_bound
    tests, exercise = graded_cells(instructor), exercise_of(instructor)
    wanted = {gid: forbidden_of(cell) for gid, cell in tests.items()}
    wanted = {gid: f for gid, f in wanted.items() if f and exercise[gid]}
    if not wanted:
        return {}
    given = given_statements(instructor) if given is None else given
    code = [(nbgrader_meta(c).get("grade_id"), parse(c.source)) for c in student.cells
            if c.cell_type == "code"]
    aliases = import_aliases(tree for _, tree in code)
    cells = []     # (grade_id, tree, [(names bound, statement)] of the learner's bindings)
    for gid, tree in code:
        check()
        lines = learners_lines(tree, given) if gid not in tests else set()
        binds = [(names_bound(stmt), stmt) for stmt in statements(tree)
                 if stmt.lineno in lines and isinstance(stmt, BINDS)]
        cells.append((gid, tree, binds))
    found = {}
    for test, forbidden in wanted.items():
        refs, direct, edges, hits = references(forbidden), {}, {}, set()
        for gid, tree, binds in cells:
            check()
            if gid == exercise[test]:
                hits |= refs.in_tree(tree, ChainMap(import_aliases([tree]), aliases))
                hits |= _reached(_loaded(tree), direct, edges)
                break                          # cells below the exercise cannot serve it
            if gid in tests:
                continue
            for names, stmt in binds:
                named, loads = refs.in_tree(stmt, aliases), _loaded(stmt)
                for name in names:
                    direct.setdefault(name, set()).update(named)
                    edges.setdefault(name, set()).update(loads)
        if hits:
            found[test] = sorted(hits)
    return found


def _reached(start: Set[str], direct: Dict[str, Set[str]], edges: Dict[str, Set[str]]) -> Set[str]:
    """The references reached from the names ``start`` through the learner's bindings
    (a name leads to what its statements name and to the names they use): one visit
    of each name."""
    seen, todo, refs = set(), [n for n in start if n in edges], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        refs |= direct.get(name, set())
        todo.extend(n for n in edges.get(name, ()) if n in edges and n not in seen)
    return refs


# --- run-time guard (kernel side) -------------------------------------------

_state: dict = {"undo": [], "violations": [], "trusted": set()}
_THREAD_MACHINERY = ("threading.py", "concurrent/futures/thread.py", "multiprocessing/pool.py")


def _cell_file(filename: str, cells: Set[str]) -> bool:
    """Code compiled from a notebook cell (ipykernel names it /tmp/ipykernel_<pid>/<hash>.py)."""
    return (filename in cells or filename.startswith("<ipython-input")
            or bool(_KERNEL_FILE.search(filename)))


def _check(name: str) -> None:
    """Raise when the nearest notebook-cell frame on the stack is not trusted."""
    import linecache
    import sys
    try:
        cells = set(getattr(get_ipython().compile, "_filename_map", {}))  # noqa: F821
    except NameError:
        cells = set()
    caller = frame = sys._getframe(2)
    while frame is not None:
        fn = frame.f_code.co_filename
        if _cell_file(fn, cells) or fn in _state["extra_cells"]:
            source = "".join(linecache.getlines(fn)).strip()
            if source in _state["trusted"]:
                return
            _state["violations"].append(name)
            raise ForbiddenCall(MESSAGE.format(name))
        frame = frame.f_back
    # No notebook frame: handed to a thread as its work (pool.submit(ref, ...), Thread(target=ref),
    # a partial of it, or a library function that calls it, pool.submit(tree_map, ref, ...)): a
    # worker has no frame of the cell that sent it, only the thread machinery somewhere below.
    # Only frames of the standard library or torch may lie in between: a library's own thread running
    # its own code (a frame of that library) calls what it likes.
    frame = caller
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.endswith(_THREAD_MACHINERY):
            _state["violations"].append(name)
            raise ForbiddenCall(MESSAGE.format(name))
        if not filename.startswith(_pass_through_dirs()):
            return
        frame = frame.f_back


def _pass_through_dirs() -> tuple:
    """Where a function passed along to a thread may pass through: the standard library, torch."""
    import os
    import torch
    return (os.path.dirname(os.__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def _wrap(name: str, impl):
    def guard(*args, **kwargs):
        _check(name)
        return impl(*args, **kwargs)
    guard.__wrapped__ = impl
    guard.__name__ = getattr(impl, "__name__", name.rsplit(".", 1)[-1])
    return guard


def install(forbidden: List[str], trusted: List[str], namespace: Optional[dict] = None,
            transform=None, extra_cells: Iterable[str] = ()) -> List[str]:
    """Guard each reference until :func:`uninstall`; return the names guarded.

    ``trusted``: sources of the instructor's cells (as the kernel compiled them,
    ``transform`` applied), whose frames may call the references.
    """
    import sys
    uninstall()
    transform = transform or (lambda s: s)
    _state.update(violations=[], trusted={transform(s).strip() for s in trusted},
                  extra_cells=set(extra_cells))
    done: List[str] = []
    targets = {}
    for name in forbidden:
        obj = _resolve(name)
        if obj is None:
            continue
        owner = _resolve(name.rsplit(".", 1)[0])
        if isinstance(owner, type):                 # torch.Tensor.chunk and friends
            _set(owner, name.rsplit(".", 1)[1], _wrap(name, obj))
        elif isinstance(obj, type):                 # a class: every alias calls __init__
            _set(obj, "__init__", _wrap(name, obj.__init__), had="__init__" in obj.__dict__)
        else:
            if isinstance(obj, types.FunctionType) and not obj.__code__.co_freevars:
                _swap_code(name, obj)               # aliases in closures call it too
            targets[id(obj)] = (obj, _wrap(name, obj))
        done.append(name)
    for mod in list(sys.modules.values()):          # every module attribute naming one
        d = getattr(mod, "__dict__", None)
        if isinstance(d, dict):
            for key, value in list(d.items()):
                if id(value) in targets and value is targets[id(value)][0]:
                    _set(mod, key, targets[id(value)][1])
    for key, value in list((namespace or {}).items()):  # aliases the learner made earlier
        if id(value) in targets and value is targets[id(value)][0]:
            _setitem(namespace, key, targets[id(value)][1])
    return done


def _set(owner, attr, value, had=None):
    old = owner.__dict__.get(attr)
    had = old is not None if had is None else had
    setattr(owner, attr, value)
    _state["undo"].append(lambda: setattr(owner, attr, old) if had else delattr(owner, attr))


def _setitem(d, key, value):
    old = d[key]
    d[key] = value
    _state["undo"].append(lambda: d.__setitem__(key, old))


def _swap_code(name: str, fn) -> None:
    """Make ``fn`` itself check its caller (catches aliases held in closures)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    key = f"__mgpu_lab_guard_{id(fn)}"
    fn.__globals__[key] = (_check, name, copy)
    src = (f"def _g(*args, **kwargs):\n    c, n, f = {key}\n    c(n)\n"
           f"    return f(*args, **kwargs)\n")
    scope: dict = {}
    exec(compile(src, "<mgpu_lab guard>", "exec"), fn.__globals__, scope)
    old = (fn.__code__, fn.__defaults__, fn.__kwdefaults__)
    fn.__code__, fn.__defaults__, fn.__kwdefaults__ = scope["_g"].__code__, None, None

    def undo():
        fn.__code__, fn.__defaults__, fn.__kwdefaults__ = old
        fn.__globals__.pop(key, None)
    _state["undo"].append(undo)


def uninstall() -> List[str]:
    """Put every reference back; return the violations seen since :func:`install`."""
    while _state["undo"]:
        _state["undo"].pop()()
    return list(dict.fromkeys(_state["violations"]))


# --- what the runner sends into the kernel ------------------------------------------

_IN_KERNEL = '__import__("mgpu_lab.course.grading.guard", fromlist=["guard"])'
UNINSTALL = f"{_IN_KERNEL}.uninstall()"     # a user expression: its value lists the calls seen


def install_code(forbidden: List[str], trusted: List[str]) -> str:
    """Code run silently in the kernel before a graded cell: guards ``forbidden``;
    ``trusted``: the sources of the cells that may call them (the graded cell and the
    instructor's given cells)."""
    return (f"{_IN_KERNEL}.install({list(forbidden)!r}, {list(trusted)!r}, "
            "get_ipython().user_ns, get_ipython().transform_cell)")


def read_violations(reply: dict, forbidden: List[str]) -> List[str]:
    """The references the kernel's reply to :data:`UNINSTALL` says were called; only names
    of ``forbidden`` (the reply comes from the learner's process)."""
    value = reply.get("user_expressions", {}).get("v", {})
    try:
        seen = ast.literal_eval(value.get("data", {}).get("text/plain", "[]"))
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return []
    allowed = set(forbidden)
    return [v for v in dict.fromkeys(seen if isinstance(seen, list) else [])
            if isinstance(v, str) and v in allowed]
