"""Generated mutants (issue 44): attacks made from the solutions and the hand-written mutants,
for every exercise, not written one by one.

- **vacuity** (kind ``vacuity``): the solution cell, then every function it defines (and every
  method of a class it defines) wrapped so that what it returns is emptied: a list or dict
  empty, a tensor without rows (a 0-dim one: without items), a tuple item by item; numbers,
  strings and None stay. The probe's results are then hollow and must fail the case check,
  or the learner's code raises on them, or a check's assertion fails: a score of 0, never
  a crash of the check itself. An exercise whose functions return only numbers, or nothing
  (they work in place, or write files), cannot be hollowed so: it is in :data:`NOT_HOLLOWED`,
  saying why, and for it, as for every graded cell, the judge-level replay (tests/test_cases.py:
  the probe's results emptied, and cut to their first case) is the evidence.
- **a rewrite thread** (kind ``copy``): the exercise's first ``copy`` mutant, and a daemon
  thread the cell starts that polls the kernel's namespace for the names its graded cells'
  probes bind (their ``expects``) and, once they are bound and the cell that bound them has
  ended, empties them in place (``list.clear``, ``dict.clear``, ``Tensor.zero_``): what a
  grader that read the results after the cell would have seen. It takes the copy mutant's
  place in the rounds: the copy's own verdict stands (the judge has the probe's snapshot,
  grading/snapshot.py), so its evidence is kept. (A thread that empties them while the probe
  runs only costs the learner points: the solution with it scored 0 on 23 exercises.)
- **the reference under another name, from a thread-pool worker** (kind ``reference``): the
  exercise's first ``reference`` mutant with each spelling of what the exercise re-implements
  (its graded cells' ``reimplements``) reached under another name bound just before use,
  ``getattr(owner, "na" + "me")``, the owner being ``X`` of ``X.name`` or, for a bare name or a
  ``from M import name``, the module ``M`` (``__import__``); the owner is bound to a name of
  its own first, and a ``getattr`` of a built name the mutant already had gets its owner so
  too (the static pass flags a ``getattr`` of a built name on a module it sees imported,
  and this attack is meant to run). Every function the cell defines (methods too) runs in a
  ``concurrent.futures.ThreadPoolExecutor`` worker (grad mode, inference mode and autocast
  carried over). One mutant for the two attack classes: the run grades with the "must not
  call" guard off, so each is killed by what the reference computes, not by how it was
  reached, and one slot per exercise keeps the rounds few. It takes the hand-written
  reference mutant's place in the rounds (it computes the same thing).

The rewrite thread looks for the names only while the kernel's input history says that no
cell after the exercise's graded cells has started (given cells in between counted): a probe
that raised before binding them never lets it empty another exercise's results.
"""
from __future__ import annotations

import ast
import builtins
from pathlib import Path
from typing import Dict, List

from . import Mutant

ROOT = Path(__file__).resolve().parents[2]

# Exercises whose results no wrapping of the cell's functions can hollow, and why (the
# judge-level replay of tests/test_cases.py covers their graded cells).
NOT_HOLLOWED: Dict[tuple, str] = {
    ("01_data_parallel", "lr_for_batch"): "returns a number; the probe makes the list",
    ("03_ddp_and_launching", "ex3_save_on_each_node"): "writes checkpoint files and returns nothing; "
        "the probe loads the files",
    ("03_ddp_and_launching", "ex5_setup"): "a %%writefile cell (lab03_setup.py): setup() returns numbers and "
        "a device; the probe makes the lists from what the ranks report",
    ("03_ddp_and_launching", "ex6_ddp_script"): "a %%writefile cell (lab03_ddp.py): main() returns nothing; the "
        "probe reads torchrun's exit code, output and saved weights",
    ("04_ring_allreduce_and_ddp", "ex1_bytes"): "returns a number of bytes; the probe makes the dict",
    ("04_ring_allreduce_and_ddp", "ex3_naive_sync"): "averages the gradients in place and returns nothing; "
        "the probe reads the trained weights",
    ("04_ring_allreduce_and_ddp", "ex6_alpha_beta"): "returns numbers (a fit, a rank count or None)",
    ("05_mixed_precision", "ex1_update_scale"): "returns a tuple of numbers",
    ("06_gradient_accumulation", "ex1_token_window"): "returns the window's loss (a number); the probe reads "
        "the gradients off the model",
    ("06_gradient_accumulation", "ex4_plan"): "returns a pair of numbers",
    ("06_gradient_accumulation", "ex5_ragged_tokens"): "returns a number; the probe reads the gradients",
    ("07_activation_checkpointing", "ex3_choose_segments"): "returns a number or None",
    ("08_faults", "ex1_atomic_save"): "writes files and returns nothing; the probe reads the folder",
    ("08_faults", "ex6_reshard"): "save_sharded writes files, load_sharded returns the step (a number) and "
        "loads in place",
    ("10_sharding", "ex2_sharded_step"): "steps the model in place and returns nothing",
    ("10_sharding", "ex5_memory_plan"): "returns a pair of numbers or None",
    ("10_sharding", "ex6_fully_shard"): "returns the model it shards in place; the probe reads what it holds",
    ("12_pipeline_parallel", "choose_schedule"): "returns a name and two numbers, or None",
    ("13_capstone", "parallelize"): "returns the model it parallelizes in place; the probe reads its runs",
    ("15_expert_parallel", "plan_experts"): "returns a pair of numbers or None",
}

HOLLOW = '''
def _mutant_hollow(value):
    """`value` emptied: a list or dict empty, a tensor without rows (items), a tuple item by item."""
    import torch
    if isinstance(value, torch.Tensor):
        return value[:0] if value.dim() else value.reshape(-1)[:0]
    if isinstance(value, tuple):
        return tuple(_mutant_hollow(v) for v in value)
    if isinstance(value, list):
        return []
    if isinstance(value, dict):
        return {}
    return value


def _mutant_hollowed(fn):
    import functools

    @functools.wraps(fn)
    def hollowed(*args, **kwargs):
        return _mutant_hollow(fn(*args, **kwargs))
    return hollowed
'''

POOLED = '''
def _mutant_pooled(fn):
    """`fn` run in a ThreadPoolExecutor worker (the caller's grad mode and autocast carried)."""
    import concurrent.futures
    import contextlib
    import functools
    import torch

    @functools.wraps(fn)
    def pooled(*args, **kwargs):
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        amp = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]

        def work():
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.inference_mode(inference))
                stack.enter_context(torch.set_grad_enabled(grad))
                for device, dtype in amp:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
                return fn(*args, **kwargs)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(work).result()
    return pooled
'''

METHODS = '''
def _mutant_methods(cls, wrap):
    """Every method `cls` defines (not its dunders), wrapped with `wrap`."""
    import inspect
    for key, attr in list(vars(cls).items()):
        if key.startswith("__"):
            continue
        if isinstance(attr, staticmethod):
            setattr(cls, key, staticmethod(wrap(attr.__func__)))
        elif isinstance(attr, classmethod):
            setattr(cls, key, classmethod(wrap(attr.__func__)))
        elif inspect.isfunction(attr):
            setattr(cls, key, wrap(attr))
'''

REWRITE = '''
def _mutant_rewrite_after_the_probe(readers, window):
    """A daemon thread: once a probe has bound every name of `readers` (other objects than when
    this cell ran) and the cell that bound them has ended, empty them in place, once. It stops
    looking when a cell `window` + 1 cells after this one starts (their probe never bound them).
    `readers`: each name's reader, a lambda that names it (NameError while it is unbound): the
    kernel's namespace is reached by the names written out (holding it, or globals(), or
    vars(__main__) with a computed key, is flagged as tampering)."""
    import threading
    import time
    import torch
    absent = object()
    names = list(readers)

    def read(name, default=None):
        try:
            return readers[name]()
        except NameError:
            return default
    shell = read("get_ipython")()       # (a call of get_ipython by its name is flagged as tampering)
    history = read("_ih")               # one entry per cell run with history: not the graded cells
    start = len(history)
    names = [name for name in names if name not in ("get_ipython", "_ih")]
    before = {name: read(name) for name in names}

    def empty(value):
        try:
            if isinstance(value, (list, dict)):
                value.clear()
            elif isinstance(value, tuple):
                for item in value:
                    empty(item)
            elif isinstance(value, torch.Tensor):
                with torch.no_grad():
                    value.zero_()
        except Exception:
            pass

    def watch():
        running, bound = None, None
        while bound is not None or len(history) <= start + window:
            if bound is None:
                if all(read(name, absent) is not absent and read(name) is not before[name] for name in names):
                    running, bound = shell.last_execution_result, [read(name) for name in names]
            elif shell.last_execution_result is not running:      # that cell has ended
                now = [read(name) for name in names] if len(history) <= start + window else []
                for value in {id(v): v for v in bound + now if v is not None}.values():
                    empty(value)
                return
            time.sleep(0.005)
    threading.Thread(target=watch, name="rewrites the probe's results", daemon=True).start()
'''


# --- reading the solutions -------------------------------------------------------------

class Lab:
    """What the generator reads of one solution notebook."""

    def __init__(self, lab: str):
        import nbformat
        from mgpu_lab.course.grading.guard import forbidden_of
        from mgpu_lab.course.notebook.cells import (DEMO_TAG, course_meta, exercise_of, graded_cells,
                                                    nbgrader_meta, tags)
        from mgpu_lab.course.notebook.notebooks import make_lab
        solution = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
        graded = graded_cells(solution)
        self.answers = {nbgrader_meta(c)["grade_id"]: c.source for c in solution.cells
                        if nbgrader_meta(c).get("solution")}
        self.graded: Dict[str, List[str]] = {}
        for gid, ex in exercise_of(solution).items():
            self.graded.setdefault(ex, []).append(gid)
        self.expects = {gid: sorted(course_meta(cell).get("expects", {})) for gid, cell in graded.items()}
        self.forbidden = {ex: sorted({f for gid in gids for f in forbidden_of(graded[gid])})
                          for ex, gids in self.graded.items()}
        # cells between an exercise and each of its graded cells that the grader runs with history
        self.window: Dict[str, int] = {}
        last, between = None, 0
        for cell in make_lab(solution).cells:
            meta = nbgrader_meta(cell)
            if cell.cell_type != "code" or not cell.source.strip() or DEMO_TAG in tags(cell):
                continue
            if meta.get("solution"):
                last, between = meta.get("grade_id"), 0
            elif meta.get("grade"):
                self.window[meta["grade_id"]] = between
            elif last is not None:
                between += 1


# --- source transformations ------------------------------------------------------------

def _split(name: str) -> str:
    """``"na" + "me"``: a name built at run time."""
    half = max(1, len(name) // 2)
    return f"{name[:half]!r} + {name[half:]!r}"


def _magic(source: str):
    """``(file, body)`` of a ``%%writefile`` cell, else None."""
    first, _, body = source.partition("\n")
    words = first.split()
    if words[:1] == ["%%writefile"] and len(words) == 2:
        return words[1], body
    return None


def as_python(source: str) -> str:
    """The cell as Python: a ``%%writefile FILE`` cell writes its file with ``Path.write_text``."""
    magic = _magic(source)
    if magic is None:
        return source
    file, body = magic
    return f"from pathlib import Path as _MutantPath\n_MutantPath({file!r}).write_text({body!r})\n"


def defined(source: str):
    """``(functions, classes)`` the cell defines at its top level."""
    tree = ast.parse(source)
    functions = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    return functions, classes


def wrapped(source: str, helpers: str, wrap: str) -> str:
    """``source`` then ``helpers`` and every top-level function and class method wrapped with ``wrap``."""
    functions, classes = defined(source)
    lines = [helpers.strip("\n"), "", ""]
    lines += [f"{name} = {wrap}({name})" for name in functions]
    if classes:
        lines[0] += "\n\n" + METHODS.strip("\n")
        lines += [f"_mutant_methods({name}, {wrap})" for name in classes]
    return source.rstrip("\n") + "\n\n\n" + "\n".join(lines) + "\n"


def _compound(stmt) -> bool:
    """Whether ``stmt`` holds statements (a node in it outside them is in its header)."""
    return any(isinstance(getattr(stmt, f, None), list) and getattr(stmt, f)
               and isinstance(getattr(stmt, f)[0], ast.stmt) for f in ("body", "orelse", "handlers", "finalbody"))


def _offsets(source: str):
    """A function: ``(line, utf-8 column)`` of an ast node -> index into ``source``."""
    starts, total = [], 0
    lines = source.splitlines(keepends=True)
    for line in lines:
        starts.append(total)
        total += len(line)

    def index(lineno: int, col: int) -> int:
        text = lines[lineno - 1]
        return starts[lineno - 1] + len(text.encode("utf-8")[:col].decode("utf-8"))
    return index


def renamed_reference(source: str, forbidden: List[str]) -> str:
    """``source`` with each spelling of a name in ``forbidden`` reached under another name, bound
    just before the statement that uses it: ``getattr(owner, "na" + "me")``, the owner being
    ``X`` of ``X.name``, or for a bare ``name`` (not bound in the cell) or a ``from M import
    name [as N]``, the module ``M`` the forbidden name lives in (``__import__("M")``). The owner is
    bound to a name of its own first: the static pass flags ``getattr`` of a built name on a
    module it sees imported, and the attack is meant to run (where the statement is a compound
    one's header, or ``X`` names a lambda's or comprehension's variable, the alias is inline)."""
    last = {}
    for f in forbidden:
        module, _, name = f.rpartition(".")
        last.setdefault(name, module or "__main__")      # a bare name: one of the notebook's
    tree = ast.parse(source)
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    imported = {}                                   # local name -> (module, name) of a forbidden import
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.name in last:
                    imported[a.asname or a.name] = (node.module, a.name)
    index = _offsets(source)
    edits, count = [], [0]                          # (start, end, text)
    inserts = {}                                    # statement -> [binding lines]

    def statement(node):
        while not isinstance(node, ast.stmt):
            node = parents[node]
        return node

    def scoped(node, names) -> bool:
        """Whether one of ``names`` is a lambda's or comprehension's variable around ``node``."""
        while not isinstance(node, ast.stmt):
            node = parents[node]
            if isinstance(node, ast.Lambda) and names & {a.arg for a in node.args.args}:
                return True
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
                if names & targets:
                    return True
        return False

    def alias(node, owner: str, name: str, names=frozenset()) -> None:
        stmt = statement(node)
        start, end = index(node.lineno, node.col_offset), index(node.end_lineno, node.end_col_offset)
        if _compound(stmt) or scoped(node, set(names)):
            edits.append((start, end, f"getattr(({owner},)[0], {_split(name)})"))
            return
        k = count[0]
        count[0] += 1
        inserts.setdefault(stmt, []).extend([f"_mutant_owner_{k} = {owner}",
                                             f"_mutant_ref_{k} = getattr(_mutant_owner_{k}, {_split(name)})"])
        edits.append((start, end, f"_mutant_ref_{k}"))

    def owner_only(node, names) -> None:
        """``getattr(X, built)`` already in the mutant: X bound to a name of its own first."""
        stmt, k = statement(node), count[0]
        start, end = index(node.lineno, node.col_offset), index(node.end_lineno, node.end_col_offset)
        if _compound(stmt) or scoped(node, set(names)):
            edits.append((start, end, f"({source[start:end]},)[0]"))
            return
        count[0] += 1
        inserts.setdefault(stmt, []).append(f"_mutant_owner_{k} = {source[start:end]}")
        edits.append((start, end, f"_mutant_owner_{k}"))

    def module(path: str) -> str:
        return f"__import__({path!r}, fromlist=['_'])"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
            owner_only(node.args[0], {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)})
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in last:
            inner = source[index(node.value.lineno, node.value.col_offset):
                           index(node.value.end_lineno, node.value.end_col_offset)]
            alias(node, inner, node.attr, {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)})
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in imported:
                alias(node, module(imported[node.id][0]), imported[node.id][1])
            elif node.id in last and node.id not in bound and not hasattr(builtins, node.id):
                alias(node, module(last[node.id]), node.id)
    for node in ast.walk(tree):                     # the forbidden names leave the imports
        if isinstance(node, ast.ImportFrom) and any(a.name in last for a in node.names) and node.module \
                and not node.level:
            kept = [a for a in node.names if a.name not in last]
            text = (f"from {node.module} import " + ", ".join(
                a.name + (f" as {a.asname}" if a.asname else "") for a in kept)) if kept else "pass"
            edits.append((index(node.lineno, node.col_offset), index(node.end_lineno, node.end_col_offset), text))
    for stmt, bindings in inserts.items():
        at = index(stmt.lineno, stmt.col_offset)
        indent = " " * stmt.col_offset
        edits.append((at, at, "".join(b + "\n" + indent for b in bindings)))
    out, edits = source, sorted(edits, key=lambda e: (e[0], e[1]))
    assert all(a[1] <= b[0] for a, b in zip(edits, edits[1:])), "overlapping aliases"
    for start, end, text in reversed(edits):
        out = out[:start] + text + out[end:]
    ast.parse(out)
    return out


# --- the mutants -----------------------------------------------------------------------

def _first(hand: List[Mutant], lab: str, exercise: str, kind: str):
    return next((m for m in hand if m.lab == lab and m.exercise == exercise and m.kind == kind), None)


def generated(hand: List[Mutant]) -> List[Mutant]:
    """The generated mutants of every exercise that ``hand`` (the hand-written mutants) covers."""
    out = []
    for lab in sorted({m.lab for m in hand}):
        info = Lab(lab)
        for ex, gids in info.graded.items():
            if (lab, ex) not in NOT_HOLLOWED:
                out.append(Mutant(lab, ex, "vacuity", "every_result_emptied",
                                  "the solution with what each of its functions returns emptied (lists and "
                                  "dicts empty, tensors without rows, tuples item by item)",
                                  lambda solution: wrapped(solution, HOLLOW, "_mutant_hollowed"),
                                  generated=True))
            copy = _first(hand, lab, ex, "copy")
            if copy is not None:
                calls = "\n".join(
                    "_mutant_rewrite_after_the_probe({" + ", ".join(
                        f"{n!r}: lambda: {n}" for n in ("get_ipython", "_ih", *info.expects[g])) + "}, "
                    f"{info.window[g]})" for g in gids if info.expects[g])
                out.append(Mutant(lab, ex, "copy", f"{copy.name}_and_a_rewrite_thread",
                                  f"{copy.mistake}; and a thread that empties the probe's results in place "
                                  f"once they are bound",
                                  lambda solution, copy=copy, calls=calls: as_python(copy.make(solution)).rstrip("\n")
                                  + "\n\n\n" + REWRITE.strip("\n") + "\n\n\n" + calls + "\n",
                                  replaces=copy.name, generated=True))
            ref = _first(hand, lab, ex, "reference")
            if ref is not None:
                out.append(Mutant(lab, ex, "reference", f"{ref.name}_renamed_in_a_pool_worker",
                                  f"{ref.mistake}; the reference under another name (getattr of a built name), "
                                  f"every function in a thread-pool worker",
                                  lambda solution, ref=ref, forbidden=info.forbidden[ex]: wrapped(
                                      renamed_reference(ref.make(solution), forbidden), POOLED, "_mutant_pooled"),
                                  replaces=ref.name, generated=True))
    return out
