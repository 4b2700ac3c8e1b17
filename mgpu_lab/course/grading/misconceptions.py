"""Known misconceptions: a failed answer told which classic mistake its results show.

Every exercise has *wrong* mutants (``tests/mutants/labNN_*.py``): plausible answers with
the topic's classic conceptual error, each named by its docstring. They are the course's
misconceptions. A failed check names the one the learner's results match.

**Why fingerprints, stored at authoring time.** The judge's cases are its own and
deterministic (seeded inputs, :mod:`.cases`), so running each misconception "on the
same cases" needs no code at grading: ``mgpu-lab labs expects --misconceptions``
(:func:`~mgpu_lab.course.authoring.labs_command.write_misconceptions`) grades every
wrong mutant of the lab through the real grader (twice), and stores in the solution's
graded cell (``metadata.mgpu_lab.misconceptions``, stripped from the student labs as
``expects`` is) a list of ``{"id", "message", "section", "fingerprint"}``. The judge
never runs a mutant, nor imports tests/, and the course ships its misconceptions with
its solutions. A mutant whose results cannot be told from the solution's (it fails for
a reason the results do not hold: a file it left, a call it made) or from an earlier
mutant's, whose results differ from one grading to the next, or whose probe raised, gets
no entry: the feedback could not name it for sure. The attacks on the grader (a mutant
whose docstring starts "attack") are no misconceptions.

**Why not at grading.** Running the mutants in the judge would put tests/ code in the
grader's package and cost a run per mutant per submission; fingerprints cost a few KiB per
misconception and a projection of the answer the judge holds anyway.

**A fingerprint** (:func:`fingerprint`, one line of compact JSON) is what the probe sent
back that the judge reads (the names of ``expects``), reduced to a few numbers per case,
in bytes, not megabytes (a few KiB for lab 00's 55 cases of up to 10 tensors). A *case*:
the items of lists, tuples and dicts (of at most :data:`WIDE` items), down to
:data:`DEPTH` levels, are cases of their own, as the checks write their cases; below, or
in a wider container, a value is one case. Of a case it keeps

- its signature (:mod:`.cases`: structure, dtypes, shapes) and its other leaves (strings,
  bools, None, dict keys), each by a short hash;
- its numbers (every tensor's elements and every number, in order, as float64): the
  values themselves when there are at most :data:`PROJECTIONS`, else their norm and
  :data:`PROJECTIONS` fixed pseudo-random projections (weights ``frac(i * phi)`` of the
  element's index: IEEE arithmetic, the same on any machine; made once, applied by chunks);
  NaNs and infinities are counted, not summed;
- a path the cell leaves free (``metadata.mgpu_lab.free``): nothing of its value.

**Matching** (:func:`closest`): a fingerprint matches a misconception's when every case
(visible and hidden) has the same signature and other leaves, the same counts of NaNs,
and numbers within the loosest tolerance of its dtypes (:data:`RTOL`: relative to the
case's norm, so that float noise from another CPU's kernels holds, while a different
result does not; integers almost exactly). Where several match, the closest (the
smallest worst-case distance, in units of the tolerance). It runs in the judge, on the loaded answer, when a check fails; the
reply carries the misconception's id only, and the grader words it from the
instructor's notebook (:func:`hint`): what the answer does, and the section to re-read.
It says nothing about the cases (no input, no value): only which known mistake matches.
The fingerprint is taken before the judge part runs (it may change the tensors it reads),
only where the cell has misconceptions and the answer has the containers and lengths of
one (:func:`could_match`: its containers, lengths and case signatures; its cost is bounded by
the solution's cases).

**Where none matches** (:func:`first_difference`): the solution's own fingerprint is stored
too (``metadata.mgpu_lab.reference``, with the numbers of each visible case of at most
:data:`VALUES` numbers), and the feedback says what the check compared (the results it reads,
case by case) and where the answer first differs from the solution's, visible results first:
for a visible case its path and the kind of difference, and for a small one the element and
its expected value (never the answer's own number: the learner's code computed it in the
grader's kernel, where it can read the hidden inputs, so "got" would carry them out, as an
exception's message would: docs/INSTRUCTORS.md); for a hidden case (a result only hidden lines bind, or one they feed:
:func:`.hidden.fed_names`) only the kind of difference, never its place or values.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, Iterable, List, Optional, Tuple

PROJECTIONS = 4
CHUNK = 1 << 18               # elements per step of a projection (its weights: 8 MiB, made once)
RTOL = {"float64": 1e-3, "float32": 1e-3, "float16": 2e-2, "bfloat16": 2e-2,
        "complex64": 1e-3, "complex128": 1e-3}
EXACT_RTOL = 1e-6             # integer and bool tensors (their float64 sums are exact)
NUMBER_RTOL = 1e-4            # a Python float (an int against an int: exact)
ATOL = 1e-9
SHORT = 40                    # a string longer than this is kept as its hash
DEPTH = 4                     # container levels whose items are cases of their own
WIDE = 128                    # a container of more items is one case
VALUES = 16                   # numbers of a visible case the reference keeps (element, expected)
MESSAGE_LIMIT = 480           # characters of a misconception's message in feedback
SECTION_LIMIT = 120
from .cases import MISCONCEPTIONS as META    # the graded cell's metadata.mgpu_lab key


# --- fingerprints -----------------------------------------------------------------------

_PHI = [math.modf(math.sqrt(p))[0] for p in (2, 3, 5, 7, 11, 13)]
_BASE: dict = {}


def _base(n: int):
    """The weights of the first ``n`` elements of a chunk, one row per projection, in
    [-0.5, 0.5): ``frac(i * phi_j)`` (IEEE float64: the same on any machine), made once."""
    import torch
    if "w" not in _BASE:
        i = torch.arange(CHUNK, dtype=torch.float64)
        _BASE["w"] = torch.stack([torch.frac(i * _PHI[j] + 0.5 * _PHI[j + 1]) - 0.5
                                  for j in range(PROJECTIONS)])
    return _BASE["w"][:, :n]


def _chunk_factor(q: int, j: int) -> float:
    """Chunk ``q``'s factor on projection ``j``: elements of different chunks weigh differently."""
    return 1.0 + math.modf(q * _PHI[(j + 2) % len(_PHI)])[0]


class _Case:
    """The leaves of one case, flattened: its numbers (in order), its other leaves, the
    loosest tolerance of its dtypes."""

    def __init__(self, free):
        import torch
        from .cases import kind_of
        self.chunks, self.exact, self.rtol = [], [], EXACT_RTOL
        self.free, self.torch, self.kind = free, torch, kind_of

    def add(self, value, path) -> None:
        """``path``: the value's path, where the cell has free paths (else None: not needed)."""
        if path is not None and any(f.match(path) for f in self.free):
            self.exact.append("free")
        elif isinstance(value, self.torch.Tensor):
            x = self.torch.view_as_real(value.detach()) if value.is_complex() else value.detach()
            self.chunks.append(x.reshape(-1))
            self.rtol = max(self.rtol, RTOL.get(str(value.dtype).replace("torch.", ""), EXACT_RTOL))
        elif isinstance(value, bool) or value is None:
            self.exact.append(repr(value))
        elif isinstance(value, (int, float, complex)):
            numbers = [value.real, value.imag] if isinstance(value, complex) else [value]
            if self.chunks and isinstance(self.chunks[-1], list):   # numbers in a row: one chunk
                self.chunks[-1] += numbers
            else:
                self.chunks.append(numbers)
            if not isinstance(value, int):
                self.rtol = max(self.rtol, NUMBER_RTOL)
        elif isinstance(value, (list, tuple)):
            if path is None and all(type(v) in (int, float) for v in value):   # numbers: at once
                self.chunks.append(list(value))
                if not all(type(v) is int for v in value):
                    self.rtol = max(self.rtol, NUMBER_RTOL)
                return
            for i, v in enumerate(value):
                self.add(v, None if path is None else f"{path}[{i}]")
        elif isinstance(value, dict):
            for k in sorted(value, key=repr):
                self.exact.append(_short(k))
                self.add(value[k], None if path is None else f"{path}[{k!r}]")
        else:
            self.exact.append(f"{self.kind(value)}:{_short(value)}")

    def entry(self, sig: str) -> list:
        """``[signature, other leaves, rtol, numbers]``: numbers are the values themselves
        (at most :data:`PROJECTIONS`), else the norm and the projections; with the counts
        of NaN and infinite values where there are any."""
        import torch
        n = sum(len(c) if isinstance(c, list) else c.numel() for c in self.chunks)
        nans = infs = 0
        sq, proj, values = 0.0, [0.0] * PROJECTIONS, []
        start = 0
        for c in self.chunks:
            c = torch.tensor(c, dtype=torch.float64) if isinstance(c, list) else c
            for lo in range(0, c.numel(), CHUNK):
                part = c[lo:lo + CHUNK].to(torch.float64)
                bad = ~torch.isfinite(part)
                if bool(bad.any()):
                    nan = int(torch.isnan(part).sum())
                    nans, infs = nans + nan, infs + int(bad.sum()) - nan
                    part = torch.where(bad, torch.zeros_like(part), part)
                if n <= PROJECTIONS:
                    values += part.tolist()
                else:
                    sq += float(part.dot(part))
                    pos = 0
                    while pos < part.numel():    # by the case's chunks of CHUNK elements
                        q, offset = divmod(start + pos, CHUNK)
                        take = min(part.numel() - pos, CHUNK - offset)
                        w = _base(offset + take)[:, offset:]
                        for j, p in enumerate((w @ part[pos:pos + take]).tolist()):
                            proj[j] += _chunk_factor(q, j) * p
                        pos += take
                start += part.numel()
        scale = math.sqrt(12.0 / max(n, 1))      # a unit vector's projections: about unit size
        numbers = values if n <= PROJECTIONS else [math.sqrt(sq)] + [p * scale for p in proj]
        out = [_hash(sig), _hash(self.exact) if self.exact else "", self.rtol,
               [float(f"{v:.8g}") for v in numbers]]
        return out + [[nans, infs]] if nans or infs else out


def _hash(value) -> str:
    return hashlib.sha1(repr(value).encode("utf-8", "surrogatepass")).hexdigest()[:10]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= SHORT else "sha1:" + _hash(text)


def _node(value, path: str, depth: int, patterns):
    """A value's fingerprint: a container of at most :data:`WIDE` items above
    :data:`DEPTH` levels is ``["[", item, ...]`` (a list or tuple) or ``["{keys", item, ...]``
    (a dict, its keys by a hash), its items' cases in turn; anything else is one case,
    ``[signature, other leaves, rtol, numbers]`` (:meth:`_Case.entry`)."""
    from .cases import render, signature
    if patterns and any(f.match(path) for f in patterns):
        return "free"
    if depth < DEPTH and isinstance(value, (list, tuple, dict)) and 0 < len(value) <= WIDE:
        if isinstance(value, dict):
            keys = sorted(value, key=repr)
            return (["{" + _hash([_short(k) for k in keys])]
                    + [_node(value[k], f"{path}[{k!r}]", depth + 1, patterns) for k in keys])
        return ["["] + [_node(v, f"{path}[{i}]", depth + 1, patterns) for i, v in enumerate(value)]
    case = _Case(patterns)
    case.add(value, path if patterns else None)
    return case.entry(render(signature(value)))


def fingerprint(answer: dict, names: Optional[Iterable[str]] = None, free=()) -> str:
    """The fingerprint of a probe's loaded ``answer`` over ``names`` (default: all of them),
    as compact JSON: ``{name: its cases (:func:`_node`), or null when it is missing}``;
    ``free``: the cell's free path patterns (``metadata.mgpu_lab.free``), whose values are
    left out."""
    import json
    from .cases import free_patterns
    patterns = free_patterns(free)
    out = {name: _node(answer[name], name, 0, patterns) if name in answer else None
           for name in sorted(answer if names is None else names)}
    return json.dumps(out, separators=(",", ":"), sort_keys=True)


def _container(node) -> bool:
    return isinstance(node, list) and bool(node) and isinstance(node[0], str) and node[0][:1] in "[{"


def _skeleton_fits(node, value, depth: int = 0, seen: Optional[dict] = None) -> bool:
    """Whether ``value`` has the containers and lengths of fingerprint ``node`` (a walk as
    long as the stored fingerprint, whatever ``value`` holds), and at each of its cases the
    same signature (structure, dtypes, shapes: else it can match no case there, and the
    difference is its structure). So the fingerprint's cost is the stored one's: an answer
    of a million one-number cases, or of one case of a million one-number lists, where the
    solution has one small tensor cost the judge its 120 s time limit (a JudgeError).
    ``seen``: the signatures already hashed, by the value's id (one answer, several
    fingerprints)."""
    if not _container(node):
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            return True                             # "free", or not a case
        if depth < DEPTH and isinstance(value, (list, tuple, dict)) and 0 < len(value) <= WIDE:
            return False                            # the fingerprint would split it into cases
        seen = {} if seen is None else seen
        if id(value) not in seen:
            from .cases import render, signature
            seen[id(value)] = (_hash(render(signature(value))), value)   # value: keeps its id
        return seen[id(value)][0] == node[0]
    if node[0] == "[":
        if not isinstance(value, (list, tuple)) or len(value) != len(node) - 1:
            return False
        return all(_skeleton_fits(n, v, depth + 1, seen) for n, v in zip(node[1:], value))
    if not isinstance(value, dict) or len(value) != len(node) - 1:
        return False
    keys = sorted(value, key=repr)
    return node[0] == "{" + _hash([_short(k) for k in keys]) and all(
        _skeleton_fits(n, value[k], depth + 1, seen) for n, k in zip(node[1:], keys))


def could_match(answer: dict, names: Iterable[str], known: Iterable[dict]) -> bool:
    """Whether ``answer`` has the containers and lengths of some known misconception's
    fingerprint (else none can match, and no fingerprint is taken: its cost stays that of
    the solution's cases, whatever the answer holds)."""
    import json
    names, seen = sorted(names), {}
    for m in known or ():
        try:
            theirs = json.loads(m["fingerprint"])
            if sorted(theirs) == names and all(
                    (n in answer) == (theirs[n] is not None)
                    and (n not in answer or _skeleton_fits(theirs[n], answer[n], 0, seen))
                    for n in names):
                return True
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError):
            continue
    return False


def _walk(value, path: str, depth: int, patterns, out: list) -> None:
    """``(path, value)`` of each of ``value``'s fingerprint nodes (:func:`_node`), in the
    order :func:`_flat` lists them: a container's, then its items'."""
    out.append((path, value))
    if patterns and any(f.match(path) for f in patterns):
        return
    if depth < DEPTH and isinstance(value, (list, tuple, dict)) and 0 < len(value) <= WIDE:
        if isinstance(value, dict):
            for k in sorted(value, key=repr):
                _walk(value[k], f"{path}[{k!r}]", depth + 1, patterns, out)
        else:
            for i, v in enumerate(value):
                _walk(v, f"{path}[{i}]", depth + 1, patterns, out)


def _flat(node, out: list) -> None:
    """A fingerprint node's nodes in order: a container as ``("[", n)`` / ``("{keys", n)``,
    then its items; a case as its entry."""
    if _container(node):
        out.append((node[0], len(node) - 1))
        for item in node[1:]:
            _flat(item, out)
    else:
        out.append(node)


def numbers(value) -> Optional[List[float]]:
    """The numbers of one case in the order a fingerprint reads them (None: more than
    :data:`VALUES`, or not numbers)."""
    case = _Case(())
    case.add(value, None)
    out: List[float] = []
    for c in case.chunks:
        n = len(c) if isinstance(c, list) else c.numel()
        if len(out) + n > VALUES:
            return None
        out += [float(v) for v in (c if isinstance(c, list) else c.to(dtype=case.torch.float64).tolist())]
    return out


def reference(answer: dict, names: Iterable[str], free=(), veiled=()) -> dict:
    """What the solution's results are compared by when no misconception matches:
    ``{"fingerprint": its fingerprint, "values": {path: numbers}}``, the numbers of each case
    of a visible name (not in ``veiled``) that has at most :data:`VALUES` of them."""
    from .cases import free_patterns
    names, patterns = sorted(names), free_patterns(free)
    values = {}
    for name in names:
        if name in veiled or name not in answer:
            continue
        walked, nodes = [], []
        _walk(answer[name], name, 0, patterns, walked)
        _flat(_node(answer[name], name, 0, patterns), nodes)
        for (path, value), node in zip(walked, nodes):
            if isinstance(node, list):
                found = numbers(value)
                if found:
                    values[path] = [float(f"{v:.8g}") for v in found]
    return {"fingerprint": fingerprint(answer, names, free), "values": values}


def answer_nodes(answer: dict, names: Iterable[str], ref: dict, free=()):
    """``(paths, values)``: the paths of the answer's fingerprint nodes, name by name in
    sorted order, and its numbers at the reference's small visible cases (taken, as the
    fingerprint is, before the judge part runs)."""
    from .cases import free_patterns
    patterns, walked = free_patterns(free), []
    for name in sorted(names):
        if name in answer:
            _walk(answer[name], name, 0, patterns, walked)
    wanted = (ref or {}).get("values", {})
    values = {}
    for path, value in walked:
        if path in wanted:
            found = numbers(value)
            if found is not None:
                values[path] = found
    return [p for p, _ in walked], values


_KINDS = {"structure": "another type, shape, dtype, length or key",
          "leaf": "another string, bool or None",
          "nan": "NaN or infinite values where the solution's have another count",
          "values": "values that differ beyond the tolerance"}


def first_difference(mine: str, paths: List[str], ref: dict, values: Dict[str, List[float]],
                     veiled: Iterable[str] = (), several=()) -> str:
    """What the check compared and where the answer's results (fingerprint ``mine``, its
    nodes' ``paths``, its small visible cases' ``values``) first differ from the solution's
    (``ref``, :func:`reference`), visible results first; "" when no difference is seen
    (the check failed on what the fingerprints do not hold). A result in ``veiled`` is
    described by the kind of difference only. ``several``: the cell's path patterns where
    several values are right (``metadata.mgpu_lab.several``: a check of a property, not of
    the solution's value), and everything below them: never named as a difference."""
    import json
    from .cases import free_patterns
    a, b = json.loads(ref["fingerprint"]), json.loads(mine)
    veiled, patterns = set(veiled), free_patterns(several)
    names = sorted(a, key=lambda n: (n in veiled, n))
    shown = [f"`{n}`" for n in names if n not in veiled]
    hidden = len(names) - len(shown)
    what = ", ".join(shown) + (" and " if shown and hidden else "") + (
        "the hidden check's results" if hidden else "")
    said = f"The check compared {what} with the solution's, case by case: "
    starts = _starts(paths)
    for name in names:
        x, y = [], []
        _flat(a.get(name), x)
        _flat(b.get(name), y)
        for i, (r, m) in enumerate(zip(x, y)):
            kind = _differs(r, m)
            if kind is None:
                continue
            base = starts.get(name)
            path = paths[base + i] if base is not None and base + i < len(paths) else name
            if patterns and any(f.match(p) for f in patterns for p in _prefixes(path)):
                continue
            if name in veiled:
                return said + f"a hidden case first differs: {_KINDS[kind]}."
            return said + f"`{path}` is the first to differ: " + _detail(kind, r, m, ref, values, path)
        if len(x) != len(y) and not any(f.match(name) for f in patterns):
            return said + (f"`{name}`" if name not in veiled else "a hidden result") + \
                f" first differs: {_KINDS['structure']}."
    return ""


def _prefixes(path: str) -> List[str]:
    """``"a[0]['k']"`` -> ``["a", "a[0]", "a[0]['k']"]``."""
    out, depth = [], 0
    for i, ch in enumerate(path):
        if ch == "[" and depth == 0:
            out.append(path[:i])
        depth += {"[": 1, "]": -1}.get(ch, 0)
    return out + [path]


def _starts(paths: List[str]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for i, p in enumerate(paths):
        out.setdefault(p.split("[", 1)[0], i)
    return out


def _differs(r, m) -> Optional[str]:
    if r == m:
        return None
    if isinstance(r, tuple) or isinstance(m, tuple) or isinstance(r, str) or isinstance(m, str) \
            or r is None or m is None:
        return "structure"
    if r[0] != m[0] or len(r[3]) != len(m[3]):
        return "structure"
    if r[1] != m[1]:
        return "leaf"
    if r[4:] != m[4:]:
        return "nan"
    return "values" if _entry_distance(r, m) > 1.0 else None


def _detail(kind: str, r, m, ref: dict, values: dict, path: str) -> str:
    if kind != "values":
        return _KINDS[kind] + "."
    want, got = (ref.get("values") or {}).get(path), values.get(path)
    if want is not None and got is not None and len(want) == len(got):
        rtol = max(float(r[2]), float(m[2]))
        far = [_close(x, y, rtol) for x, y in zip(want, got)]
        # the first element past the tolerance; else (every element within it, their sum
        # of projections not) the farthest: the case differs, and some element must be named
        i = next((k for k, d in enumerate(far) if d > 1.0), max(range(len(far)), key=far.__getitem__, default=None))
        if i is not None and far[i] > 0.0:
            where = f"element {i} (counted flat, in order)" if len(want) > 1 else "its value"
            return f"{where}: expected {want[i]:.6g}."   # not the answer's: it can carry hidden inputs
    if len(r[3]) == PROJECTIONS + 1:
        return f"{_KINDS[kind]} (its norm: expected {r[3][0]:.6g})."
    return _KINDS[kind] + "."


# --- matching ---------------------------------------------------------------------------

def _close(a: float, b: float, rtol: float, scale: float = 0.0) -> float:
    """``|a - b|`` in units of the tolerance."""
    return abs(a - b) / (rtol * max(abs(a), abs(b), scale) + ATOL)


def _entry_distance(d: list, e: list) -> float:
    if not isinstance(d, list) or not isinstance(e, list) or len(d) != len(e) or len(d) < 4:
        return math.inf
    if d[0] != e[0] or d[1] != e[1] or d[4:] != e[4:] or len(d[3]) != len(e[3]):
        return math.inf                      # another structure, exact leaf or count of NaNs
    rtol, x, y = max(float(d[2]), float(e[2])), d[3], e[3]
    if len(x) != PROJECTIONS + 1:            # the values themselves
        return max([0.0] + [_close(a, b, rtol) for a, b in zip(x, y)])
    norm = max(abs(x[0]), abs(y[0]))         # the norm, then projections relative to it
    return max([_close(x[0], y[0], rtol)] + [_close(a, b, rtol, norm) for a, b in zip(x[1:], y[1:])])


def _node_distance(x, y) -> float:
    if isinstance(x, str) or isinstance(y, str) or x is None or y is None:
        return 0.0 if x == y else math.inf
    if _container(x) or _container(y):
        if not (_container(x) and _container(y)) or x[0] != y[0] or len(x) != len(y):
            return math.inf
        worst = 0.0
        for a, b in zip(x[1:], y[1:]):
            worst = max(worst, _node_distance(a, b))
            if worst > 1.0:
                break
        return worst
    return _entry_distance(x, y)


def distance(mine: str, theirs: str) -> float:
    """The worst case's difference of two fingerprints in units of its tolerance (``inf``:
    another structure, exact leaf or count of NaNs); <= 1: a match, on every case."""
    import json
    a, b = json.loads(mine), json.loads(theirs)
    if not isinstance(a, dict) or not isinstance(b, dict) or sorted(a) != sorted(b):
        return math.inf
    worst = 0.0
    for name in a:
        worst = max(worst, _node_distance(a[name], b[name]))
        if worst > 1.0:
            return worst
    return worst


def closest(mine: str, known: Iterable[dict]) -> Optional[Tuple[str, float]]:
    """``(id, distance)`` of the known misconception (``{"id", "fingerprint"}``) whose
    fingerprint is closest to ``mine`` among those that match (distance <= 1), else None."""
    best = None
    for m in known or ():
        try:
            d = distance(mine, m["fingerprint"])
        except (KeyError, TypeError, ValueError):
            continue
        if d <= 1.0 and (best is None or d < best[1]):
            best = (str(m["id"]), d)
    return best


# --- what the feedback says -------------------------------------------------------------

def of_cell(cell) -> List[dict]:
    """The misconceptions stored in graded cell ``cell`` (the instructor's)."""
    from .cases import stored_misconceptions
    return stored_misconceptions(cell)


def hint(cell, misconception_id: Optional[str]) -> str:
    """The feedback's sentence for a matched misconception of ``cell`` ("" when none)."""
    if not misconception_id:
        return ""
    for m in of_cell(cell):
        if m["id"] == misconception_id:
            message = " ".join(str(m.get("message") or m["id"].replace("_", " ")).split()).rstrip(".")
            if len(message) > MESSAGE_LIMIT:      # the authors' test keeps theirs shorter: a fallback
                message = message[:MESSAGE_LIMIT - 1] + "\u2026"
            section = " ".join(str(m.get("section") or "").split())
            if len(section) > SECTION_LIMIT:        # at a word, and said
                section = section[:SECTION_LIMIT - 1].rsplit(" ", 1)[0] + "\u2026"
            return ("This looks like a known misconception: " + message
                    + (f" (see '{section}')" if section else "") + ".")
    return ""


def label(misconception_id: str) -> str:
    """A misconception's short name in a class report: its id in words."""
    return str(misconception_id).replace("_", " ")[:60]

