"""A graded cell in three parts: the check's inputs, the probe, the judge.

Every graded cell of a lab is written as straight-line code in three parts::

    torch.manual_seed(0)                      # inputs: what the check feeds your code
    x = torch.randn(7, 3)
    ### PROBE: your code runs here, in your kernel
    mine = my_scatter(x, cpu3)                # only your functions, on the inputs
    ### JUDGE: compared where your code cannot reach
    ref = torch.chunk(x, 3)                   # the references and the comparisons
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    print("ex1 passed")

Run as a cell (a solution under nbval, a learner checking their work) it is
just code, top to bottom. Graded, it is split at the two marker lines:

- the **inputs** part runs in the grader's trusted *judge* process
  (:mod:`mgpu_lab.course.grading.judge`); the names it binds that are plain data
  (tensors, numbers, strings, lists, dicts: what ``torch.load(weights_only=True)``
  reads) are sent into the learner's kernel, the others are deleted there;
- the **probe** part runs in the learner's sandboxed kernel; the names it binds
  are sent back as plain data;
- the **judge** part runs in the judge process, with the inputs part's own
  objects and the probe's data, once the judge has checked that the data holds
  exactly the cases the check asked for (the solution's keys, lengths, shapes and
  dtypes: :mod:`mgpu_lab.course.grading.cases`). Its verdict is the score: nothing the learner's
  code does in its kernel (patching ``torch.equal``, IPython hooks, a notebook
  helper) reaches it.

An author's rules (``docs/AUTHORING.md``): the probe calls only the learner's
code on data from the inputs part (build models from a state dict, seed in the
probe if it draws); the judge uses what the notebook's cells tagged ``setup``
define (they run in the judge process too) and what the inputs part binds;
a reference that computes the answer lives in the judge's hidden tests or in
the library, never in a function the lab defines.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import List

from .cells import parse

PROBE = re.compile(r"^### PROBE\b.*$", re.M)
JUDGE = re.compile(r"^### JUDGE\b.*$", re.M)


@dataclass
class Parts:
    inputs: str
    probe: str
    judge: str


def split(source: str) -> Parts:
    """The three parts of a graded cell's source; ValueError when the markers are off."""
    probes, judges = list(PROBE.finditer(source)), list(JUDGE.finditer(source))
    if len(probes) != 1 or len(judges) != 1:
        raise ValueError("a graded cell needs exactly one '### PROBE' line and one "
                         f"'### JUDGE' line (found {len(probes)} and {len(judges)})")
    p, j = probes[0], judges[0]
    if j.start() < p.start():
        raise ValueError("'### JUDGE' comes before '### PROBE'")
    # Each part keeps its line numbers: blank lines stand in for the others, so an
    # error in the judge names the line of the cell.
    def lines_before(end):
        return "\n" * source.count("\n", 0, end)
    return Parts(inputs=source[: p.start()],
                 probe=lines_before(p.end()) + source[p.end(): j.start()],
                 judge=lines_before(j.end()) + source[j.end():])


def bound_names(source: str) -> List[str]:
    """Names a part binds at the top level of the cell, in order of first binding.

    As Python scopes them: assignments anywhere outside function, class and
    comprehension bodies (loop targets and ``with ... as`` included), imports,
    and the names of functions and classes defined. A cell in IPython syntax
    (``%%writefile script.py`` binds nothing) is read as the kernel runs it.
    """
    tree = parse(source)
    if tree is None:
        ast.parse(source)                       # raises the SyntaxError that says where
        raise SyntaxError("not Python, even read as IPython syntax")
    return names_bound(tree)


def names_bound(node) -> List[str]:
    """:func:`bound_names` of a parsed cell or statement (no recursion: any depth)."""
    names: List[str] = []

    def add(name):
        if name not in seen:
            seen.add(name)
            names.append(name)

    seen: set = set()
    stack = [iter(ast.iter_child_nodes(node) if isinstance(node, ast.Module) else [node])]
    while stack:
        child = next(stack[-1], None)
        if child is None:
            stack.pop()
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(child.name)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            for a in child.names:
                add((a.asname or a.name).split(".")[0])
        elif isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                                ast.GeneratorExp)):
            continue                            # their own scope
        elif isinstance(child, ast.Name):
            if isinstance(child.ctx, ast.Store):
                add(child.id)
        else:
            if isinstance(child, ast.ExceptHandler) and child.name:
                add(child.name)
            stack.append(iter(ast.iter_child_nodes(child)))
    return names
