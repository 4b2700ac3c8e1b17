"""Exercises test the learner's code: "this exercise must not call X".

A from-scratch exercise declares, on the instructor's graded cell, the
references it re-implements::

    "mgpu_lab": {"reimplements": ["mgpu_lab.scatter", "torch.nn.parallel.scatter"]}

The learner's solution cell for a graded cell is the nearest cell above it (in
the instructor's notebook) with nbgrader ``solution: true``; the submission's
cells with that ``grade_id`` are checked. Two checks, so that neither a direct
call nor an alias made earlier slips through:

- **static**, in the grader (trusted): the solution cell's syntax tree; a name or
  attribute chain that resolves to a listed reference (import aliases from any
  cell included, ``from torch import distributed as d`` → ``d.all_reduce``) fails
  it. ``torch.Tensor.m`` matches any ``.m`` attribute (a method call on a tensor).
- **at run time**, in the kernel, while the graded cell runs: each reference is
  replaced (module attributes, the learner's globals, a Python function's code,
  a class's ``__init__``, a ``torch.Tensor`` method) by a guard that raises when
  the nearest notebook-cell frame calling it is not the instructor's. Restored
  after the cell. Ranks forked by ``launch()`` inherit the guards; ranks started
  fresh (spawn) rely on the static check.
"""
from __future__ import annotations

import ast
import importlib
import re
import types
from typing import Dict, Iterable, List, Optional, Set

MESSAGE = "this exercise must not call {}"
_KERNEL_FILE = re.compile(r"ipykernel_\d+[/\\]-?\d+\.py$")


class ForbiddenCall(RuntimeError):
    """A from-scratch exercise called the reference it re-implements."""


# --- static check (grader side) ---------------------------------------------

def _parse(src: str):
    """The syntax tree of a cell, IPython syntax (``%matplotlib inline``, ``!ls``) turned
    into Python first, as the kernel does; None when it is not valid Python."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        src = TransformerManager().transform_cell(src)
    except ImportError:  # the grader runs without IPython: plain Python cells only
        pass
    try:
        return ast.parse(src)
    except SyntaxError:
        return None


def import_aliases(sources: Iterable[str]) -> Dict[str, str]:
    """``{local name: dotted name}`` from every import statement in ``sources``."""
    aliases: Dict[str, str] = {}
    for src in sources:
        tree = _parse(src)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        aliases[root] = root
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _literal_getattr(node):
    """``(obj, "name")`` for ``getattr(obj, "name")``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[0], node.args[1].value
    return None


def _dotted(node, aliases) -> Optional[str]:
    """``torch.nn.parallel.scatter`` for that chain of names (``getattr(x, "y")`` read as
    ``x.y``), the first name resolved through the import aliases; None for other nodes."""
    parts = []
    while isinstance(node, ast.Attribute) or _literal_getattr(node):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        else:
            node, attr = _literal_getattr(node)
            parts.append(attr)
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _resolve(dotted: str):
    """The object a dotted name names (importing modules as needed), or None."""
    parts = dotted.split(".")
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


def static_violations(source: str, forbidden: List[str], aliases: Dict[str, str]) -> List[str]:
    """The forbidden references that ``source`` names (empty when none)."""
    tree = _parse(source)
    if tree is None:
        return []
    aliases = dict(aliases, **import_aliases([source]))
    roots = {f.split(".")[0] for f in forbidden}
    targets = {}
    for f in forbidden:
        obj = _resolve(f)
        if obj is not None:
            targets[id(obj)] = f
    methods = {f.rsplit(".", 1)[1]: f for f in forbidden if f.startswith("torch.Tensor.")}
    found: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in methods:
            found.append(methods[node.attr])
        if not isinstance(node, (ast.Name, ast.Attribute)) and not _literal_getattr(node):
            continue
        name = _dotted(node, aliases)
        if name is None:
            continue
        if name in forbidden:
            found.append(name)
        elif name.split(".")[0] in roots and "." in name:
            obj = _resolve(name)
            if obj is not None and id(obj) in targets:
                found.append(targets[id(obj)])
    return sorted(set(found))


# --- run-time guard (kernel side) -------------------------------------------

_state: dict = {"undo": [], "violations": [], "trusted": set()}


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
    frame = sys._getframe(2)
    while frame is not None:
        fn = frame.f_code.co_filename
        if _cell_file(fn, cells) or fn in _state["extra_cells"]:
            source = "".join(linecache.getlines(fn)).strip()
            if source in _state["trusted"]:
                return
            _state["violations"].append(name)
            raise ForbiddenCall(MESSAGE.format(name))
        frame = frame.f_back


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
