"""The cases a graded check asks for, and the check that exactly those came back.

The judge owns its cases. A graded cell's judge part compares what the probe sent back;
written as loops over that data (``for n in runs``, ``zip(cases, yours)``), it asserts
nothing about a case that did not come back, and an empty list passes it. So before the
judge part runs, the judge (:mod:`.judge`) compares every name the probe bound with the
**signature** of the solution's own results on the same inputs, stored in the solution's
graded cell (``metadata.mgpu_lab.expects``, written by ``mgpu-lab labs expects``): every key,
every length, every tensor's shape and dtype. A missing, extra, empty or mis-shaped result
is the verdict, and no tensor reaches the judge part in a shape its case did not ask for
(no broadcasting to sizes the answer chose). A name the solution could not send (a module)
is not sent to the judge part at all.

A signature is a short Python expression (read with :mod:`ast`, never evaluated)::

    num  bool  str  none  bytes  dtype  device      a leaf (num: int, float, or a 0-dim tensor)
    float32(5, 2)   int64()                          a tensor: dtype, shape
    [num, str]   [float32(3)] * 4   (num, none)      a list or tuple (either is accepted)
    {'loss': float32(), 2: [num] * 3}                a dict: exactly these keys

Where the solution's structure is not the only correct one (a free design answer, what
depends on the GPUs present), the cell declares the paths it leaves free,
``metadata.mgpu_lab.free = {"plans[*]": "why"}``: a value at such a path is not compared
(its judge part bounds its own loops and checks its own shapes there). In a cell with hidden
tests a message names the result, never the lengths, keys or shapes of its cases.
"""
from __future__ import annotations

import ast
import re
from typing import Dict, List, Optional

LEAVES = ("num", "bool", "str", "none", "bytes", "dtype", "device", "other")


# --- signatures ---------------------------------------------------------------------

def signature(value):
    """The signature of plain data, as a tree: a leaf name, ``("tensor", dtype, shape)``,
    ``("seq", [items])`` or ``("dict", {key: signature})``."""
    import torch
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).replace("torch.", ""), tuple(value.shape))
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float, complex)):
        return "num"
    if value is None:
        return "none"
    for kind, types in (("str", str), ("bytes", bytes), ("dtype", torch.dtype),
                        ("device", torch.device)):
        if isinstance(value, types):
            return kind
    if isinstance(value, (list, tuple)):
        return ("seq", [signature(v) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: signature(v) for k, v in value.items()})
    return "other"


def render(sig) -> str:
    """A signature as its expression (uniform lists compressed: ``[x] * n``)."""
    if isinstance(sig, str):
        return sig
    kind, *rest = sig
    if kind == "tensor":
        return f"{rest[0]}({', '.join(map(str, rest[1]))})"
    if kind == "seq":
        items = [render(s) for s in rest[0]]
        if len(items) > 1 and len(set(items)) == 1:
            return f"[{items[0]}] * {len(items)}"
        return "[" + ", ".join(items) + "]"
    return "{" + ", ".join(f"{k!r}: {render(v)}" for k, v in rest[0].items()) + "}"


def parse(text: str):
    """The tree of a signature's expression (ValueError when it is not one)."""
    def walk(node):
        if isinstance(node, ast.Name) and node.id in LEAVES:
            return node.id
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return ("tensor", node.func.id, tuple(ast.literal_eval(a) for a in node.args))
        if isinstance(node, (ast.List, ast.Tuple)):
            return ("seq", [walk(e) for e in node.elts])
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                and isinstance(node.left, (ast.List, ast.Tuple)) and len(node.left.elts) == 1):
            return ("seq", [walk(node.left.elts[0])] * ast.literal_eval(node.right))
        if isinstance(node, ast.Dict):
            return ("dict", {ast.literal_eval(k): walk(v) for k, v in zip(node.keys, node.values)})
        raise ValueError(f"not a signature: {ast.unparse(node)[:80]}")
    return walk(ast.parse(text, mode="eval").body)


# --- the check ----------------------------------------------------------------------

def free_patterns(patterns) -> List[re.Pattern]:
    return [re.compile(re.escape(p).replace(r"\[\*\]", r"\[[^\]]*\]") + "$") for p in patterns]


def kind_of(value) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, (list, tuple, dict)):
        return "a dict" if isinstance(value, dict) else "a list"
    return {"num": "a number", "bool": "a bool", "str": "a string", "none": "None"}.get(
        signature(value), f"a {signature(value)}")


def _mismatch(sig, value, path: str, free, veiled: bool = False) -> Optional[tuple]:
    """``(path, what differs, what differs in words that reveal no case)`` or None.
    ``veiled`` (a hidden check's result): None in place of anything, or anything in place
    of the solution's None, is left to the judge part: "None where the check expects a
    list" would tell which hidden cases have no answer (a design's "no plan fits")."""
    import torch
    if any(f.match(path) for f in free):
        return None
    if veiled and (sig == "none" or value is None):
        return None
    if isinstance(sig, str):
        if sig == "num":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex())
        else:
            ok = not isinstance(value, (list, tuple, dict, torch.Tensor)) and signature(value) == sig
        want = {"num": "a number", "bool": "a bool", "str": "a string", "none": "None"}.get(sig, sig)
        return None if ok else (path, f"{kind_of(value)}, the check expects {want}",
                                f"{kind_of(value)} where the check expects another type")
    kind, rest = sig[0], sig[1]
    if kind == "tensor":
        dtype, shape = rest, sig[2]
        if shape == () and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None                                  # a 0-dim tensor or a number: a scalar
        if not isinstance(value, torch.Tensor):
            return (path, f"{kind_of(value)}, the check expects a tensor", f"{kind_of(value)} "
                    "where the check expects a tensor")
        if tuple(value.shape) != shape:
            return (path, f"a tensor of shape {tuple(value.shape)}, the check expects {shape}",
                    "a tensor of another shape than the check's case")
        if str(value.dtype).replace("torch.", "") != dtype:
            return (path, f"a tensor of dtype {value.dtype}, the check expects torch.{dtype}",
                    f"a tensor of dtype {value.dtype}, not the one the check expects")
        return None
    if kind == "seq":
        if not isinstance(value, (list, tuple)):
            return (path, f"{kind_of(value)}, the check expects a list", f"{kind_of(value)} "
                    "where the check expects a list")
        if len(value) != len(rest):
            few = len(value) < len(rest)
            return (path, f"{len(value)} item(s), the check asked for {len(rest)}",
                    f"a list with {'fewer' if few else 'more'} items than the solution's result there "
                    "(what your code returned for a case, or the cases themselves)")
        for i, (s, v) in enumerate(zip(rest, value)):
            found = _mismatch(s, v, f"{path}[{i}]", free, veiled)
            if found:
                return found
        return None
    if not isinstance(value, dict):
        return (path, f"{kind_of(value)}, the check expects a dict", f"{kind_of(value)} where "
                "the check expects a dict")
    missing = [k for k in rest if k not in value]
    if missing:
        return (path, f"no key {missing[0]!r}, which the solution's result has there",
                "a dict without a key the solution's result has there (what your code returned for a case)")
    extra = [k for k in value if k not in rest]
    if extra:
        return (path, f"a key {str(extra[0])[:40]!r} the solution's result does not have there",
                "a dict with a key the solution's result does not have there (what your code returned for a case)")
    for k, s in rest.items():
        found = _mismatch(s, value[k], f"{path}[{k!r}]", free, veiled)
        if found:
            return found
    return None


def check_cases(expects: Dict[str, str], answer: dict, free=(), hidden=None,
                missing=()) -> Optional[str]:
    """None when ``answer`` (the probe's names, loaded) holds exactly the cases of
    ``expects`` (``{name: signature expression}``; ``free``: the paths not compared), else
    what first differs, in words. ``hidden``: None for a cell without hidden tests, else
    the names only its hidden lines bind; then no message states a length, key or shape,
    nor names a hidden result."""
    patterns = free_patterns(free)
    for name in sorted(expects, key=lambda n: bool(hidden) and n in hidden):   # visible ones first
        text = expects[name]
        shown = "a hidden check's result" if hidden and name in hidden else f"`{name}`"
        if name not in answer or name in missing:
            return (f"{shown} did not come back from your kernel as plain data (tensors, "
                    "numbers, strings, lists, tuples, dicts): the check needs it")
        found = _mismatch(parse(text), answer[name], name, patterns,
                          veiled=bool(hidden) and name in hidden)
        if found:
            path, plain, veiled = found
            if hidden is not None:
                return f"{shown} does not hold the cases the check asked for: {veiled}"
            return f"`{path}` does not hold the case the check asked for: {plain}"
    return None


# --- what a vacuous answer looks like (the replay's mutants) -------------------------

def example(sig):
    """A value of signature ``sig`` (zeros, empty strings)."""
    import torch
    if isinstance(sig, str):
        return {"num": 0, "bool": False, "str": "", "none": None, "bytes": b"",
                "dtype": torch.float32, "device": torch.device("cpu")}.get(sig)
    if sig[0] == "tensor":
        return torch.zeros(sig[2], dtype=getattr(torch, sig[1]))
    if sig[0] == "seq":
        return [example(s) for s in sig[1]]
    return {k: example(s) for k, s in sig[1].items()}


def emptied(value):
    """``value`` with every list, tuple, dict and tensor emptied (numbers left)."""
    import torch
    if isinstance(value, torch.Tensor):
        return value[:0] if value.dim() else value
    if isinstance(value, (list, tuple, dict)):
        return type(value)()
    return value


def truncated(value):
    """``value`` with every list, tuple and dict cut to its first case."""
    if isinstance(value, (list, tuple)):
        return type(value)(truncated(v) for v in value[:1])
    if isinstance(value, dict):
        return {k: truncated(v) for k, v in list(value.items())[:1]}
    return value


# --- where a check's cases are written ------------------------------------------------

def names_read(judge_source: str) -> set:
    """The names a judge part reads before it binds them (by line: ``x = f(x)`` reads ``x``):
    the probe's results it compares. Only those are checked and sent to it; a probe's
    temporary that the judge part rebinds first (a loop variable) is neither."""
    from ..notebook.cells import parse as parse_cell
    tree = parse_cell(judge_source)
    loads, stores = {}, {}
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Name):
            seen = loads if isinstance(node.ctx, ast.Load) else stores
            seen[node.id] = min(seen.get(node.id, node.lineno), node.lineno)
    return {n for n, line in loads.items() if line <= stores.get(n, line)}


def cases_of(cell) -> dict:
    """What graded cell ``cell`` (the instructor's) asks for, as the judge takes it:
    ``{"expects", "free", "hidden"}`` and, where the solution stores some, its known
    ``misconceptions`` (:mod:`.misconceptions`: ids and fingerprints), the solution's
    ``reference`` fingerprint, and ``veiled``: the results only hidden lines bind or feed
    (:func:`.hidden.fed_names`), or read (:func:`.hidden.read_on_hidden`: a hidden check's); ``{}`` for a cell without ``expects`` (nothing checked)."""
    from ..notebook import graded_cell
    from ..notebook.cells import course_meta
    from ..notebook.notebooks import BEGIN_HIDDEN, strip_solution
    meta = course_meta(cell)
    if "expects" not in meta:
        return {}
    from .hidden import fed_names, read_on_hidden
    hidden, veiled = None, []
    if BEGIN_HIDDEN in cell.source:
        seen = set(graded_cell.bound_names(graded_cell.split(strip_solution(cell.source)).probe))
        hidden = sorted(set(meta["expects"]) - seen)
        veiled = sorted(set(hidden) | ((fed_names(cell.source) | read_on_hidden(cell.source))
                                       & set(meta["expects"])))
    known = [{"id": m["id"], "fingerprint": m["fingerprint"]} for m in stored_misconceptions(cell)]
    ref = meta.get(REFERENCE)
    return {"expects": dict(meta["expects"]), "free": list(meta.get("free", {})), "hidden": hidden,
            "veiled": veiled, "several": list(meta.get("several", {})),
            **({"misconceptions": known} if known else {}),
            **({"reference": ref} if isinstance(ref, dict) and "fingerprint" in ref else {})}


MISCONCEPTIONS = "misconceptions"    # a graded cell's metadata.mgpu_lab key (:mod:`.misconceptions`)
REFERENCE = "reference"              # and the solution's own fingerprint (:func:`.misconceptions.reference`)


def stored_misconceptions(cell) -> List[dict]:
    """The misconceptions stored in graded cell ``cell`` (the instructor's): ids, messages,
    sections and fingerprints (written by ``mgpu-lab labs expects --misconceptions``)."""
    from ..notebook.cells import course_meta
    found = course_meta(cell).get(MISCONCEPTIONS) or []
    return [m for m in found if isinstance(m, dict) and "id" in m and "fingerprint" in m]
