"""Mutants: plausible wrong answers, kept to prove that each exercise's check rejects them.

Each lab has a file here (``lab00_setup.py`` for ``solutions/00_setup.ipynb``) that
sets ``LAB`` and defines one function per mutant::

    @mutant("rank_slice", "wrong")
    def floor_instead_of_ceil(solution: str) -> str:
        "rows // world_size per rank: the last rows are lost"
        return swap(solution, "-(-rows // world_size)", "rows // world_size")

The function gets the exercise cell's solution source and returns the source that
is graded in its place; the docstring names the mistake. The kinds:

- ``wrong``: the topic's classic conceptual error;
- ``reference``: a call of what the exercise re-implements (directly, through an
  alias, ``getattr``, a helper defined in another cell, a thread, ``exec``, a module
  copy, a child Python): it must score 0 because the reference computes something else
  than the exercise asks (the mutation run grades with the "must not call" guard off);
- ``copy``: code visible in the student notebook, copied as the answer;
- ``tamper``: an attempt on the kernel (``torch.equal = ...``, IPython hooks, a
  redefined helper of the notebook);
- ``vacuity``: generated only (``generated.py``): the solution with what its functions
  return emptied.

``generated.py`` also makes, from the solutions and these mutants, a rewrite thread on each
exercise's first copy and each first reference renamed and run in a thread-pool worker:
those take the place of the mutant they are made from in the rounds (``replaces``).

A ``wrong`` mutant is also one of the course's *misconceptions* (:attr:`Mutant.misconception`;
not the attacks on the grader, whose docstring starts "attack"): ``mgpu-lab labs expects
--misconceptions`` stores the fingerprint of its results in the solution, and the feedback
of an answer whose results match names it (``mgpu_lab/course/grading/misconceptions.py``)
with its ``message=`` (default: the docstring) and ``section=`` (default: the lab's section
above the exercise). ``learner=`` marks a misconception a learner was seen to have (a
wrong attempt made working from the student notebook alone, kept in ``attempts/``).

``tests/test_mutants.py`` grades every lab with its mutants in place and requires a
kill rate of 100 %: each mutant scores 0 on its exercise, for the right reason.
"""
import importlib
import pkgutil
import re
import textwrap
from dataclasses import dataclass
from typing import Callable, List

KINDS = ("wrong", "reference", "copy", "tamper", "vacuity")
_REGISTRY: List["Mutant"] = []


@dataclass
class Mutant:
    lab: str
    exercise: str          # the grade_id of the exercise's solution cell
    kind: str
    name: str
    mistake: str
    make: Callable[[str], str]
    replaces: str = ""     # generated: the hand-written mutant whose place it takes in the rounds
    generated: bool = False
    message: str = ""      # a misconception's feedback, in the lab's words (default: mistake)
    section: str = ""      # the lab's section that explains it (default: the exercise's)
    learner: str = ""      # where a learner made this mistake (see ``mutant``)

    @property
    def misconception(self) -> bool:
        """A wrong answer the feedback names (``labs expects --misconceptions``): the
        ``wrong`` ones but the attacks on the grader (a docstring that starts "attack" or
        "issue 29 attack")."""
        return self.kind == "wrong" and not re.match(r"(issue \d+ )?attack\b", self.mistake.lower())


def mutant(exercise: str, kind: str, message: str = "", section: str = "", learner: str = ""):
    """Register the decorated function as a mutant of ``exercise`` (its module's LAB);
    ``message``, ``section``: how the feedback names it, where it is a misconception;
    ``learner``: where a learner working from the student notebook alone made this mistake
    (who, when, first attempt or an alternative considered), its attempt kept verbatim in
    ``tests/mutants/attempts/`` (a misconception learners have, not only one mutation yields)."""
    assert kind in KINDS, kind

    def register(fn):
        lab = importlib.import_module(fn.__module__).LAB
        _REGISTRY.append(Mutant(lab, exercise, kind, fn.__name__,
                                (fn.__doc__ or "").strip(), fn, message=message, section=section,
                                learner=learner))
        return fn
    return register


def swap(source: str, old: str, new: str, count: int = 1) -> str:
    """``source`` with ``old`` replaced by ``new`` (which must be there)."""
    assert old in source, f"mutant out of date: {old!r} is not in the solution"
    return source.replace(old, new, count)


def body(solution: str, code: str, region: int = 0) -> str:
    """The solution cell with the region between its SOLUTION markers (the first, or
    the ``region``-th from 0) replaced by ``code`` (dedented, then indented as the
    markers are)."""
    found = list(re.finditer(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION[ \t]*$",
                             solution, re.S | re.M))
    assert len(found) > region, f"mutant out of date: no solution region {region} in the exercise cell"
    m = found[region]
    code = textwrap.indent(textwrap.dedent(code).strip("\n"), m.group(1))
    return solution[: m.start()] + code + solution[m.end():]


def prepend(solution: str, code: str) -> str:
    """``code`` put before the whole cell (a tampering attempt above the answer)."""
    return textwrap.dedent(code).strip("\n") + "\n" + solution


def all_mutants() -> List[Mutant]:
    """Every mutant of every lab file in this package, then the generated ones (``generated.py``)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    from .generated import generated
    hand = [m for m in _REGISTRY if not m.generated]
    return hand + generated(hand)
