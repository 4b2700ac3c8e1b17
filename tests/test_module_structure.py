"""What the library's structure promises, read from its source: one way to walk a
nested structure (torch.utils._pytree), one flatten/unflatten of tensor lists
(torch._utils), and no import circle between the modules of ``parallel/``."""
import ast
from pathlib import Path

import mgpu_lab

LIB = Path(mgpu_lab.__file__).parent
PARALLEL = LIB / "parallel"


def _local_imports(path):
    """The sibling modules a file imports, those under ``if TYPE_CHECKING:`` included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {a.name for a in node.names}
    return found


def _circles(graph) -> list:
    """The modules of ``graph`` (``{module: modules it imports}``) that reach themselves."""
    def reaches(start, target, seen):
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False
    return sorted(m for m in graph if reaches(m, m, {m}))


def test_no_import_circle_between_the_parallel_modules():
    circles = _circles({p.stem: _local_imports(p) for p in PARALLEL.glob("*.py")})
    assert not circles, f"modules in an import circle: {circles}"


def test_one_flatten_and_one_tree_walker():
    for name in ("ddp.py", "zero.py", "wrappers.py"):  # wrappers.py: GradientAccumulator's flat all-reduce
        source = (PARALLEL / name).read_text()
        assert "_unflatten_dense_tensors" in source and "offset" not in source, name  # no hand-made copy
    fsdp = ast.parse((PARALLEL / "fsdp.py").read_text())
    functions = {n.name for n in ast.walk(fsdp) if isinstance(n, ast.FunctionDef)}
    assert "_flatten" not in functions and "torch.utils._pytree" in ast.unparse(fsdp)
    grad_accum = (LIB / "training" / "grad_accum.py").read_text()
    assert "offset" not in grad_accum and "torch.cat" not in grad_accum


# --- the course package: one home per feature, arrows one way ----------------------

COURSE = LIB / "course"
# Where each module of course/ runs. The sandbox side runs with the learner's code (the
# runner and its kernels); shared modules are read by both sides; the grader side holds
# the solutions, the judges and the scores, and the sandbox side must never import it.
SIDES = {
    "sandbox": {"runner", "kernel", "sandbox", "warm_kernel"},
    "shared": {"__init__", "protocol", "cells", "graded_cell", "guard"},
    "grader": {"grader", "session", "scoring", "submission", "tamper", "judge", "report",
               "classroom", "notebooks", "labs_command", "layout", "tour", "gpu_pass",
               "author_check", "judge_pool", "exercises", "gradebook", "handins", "lms",
               "platforms", "export"},
}


def _course_imports(path):
    """``{sibling module: [private names taken from it]}`` that a course module imports,
    relatively or absolutely, anywhere in the file (function-local imports included)."""
    tree = ast.parse(path.read_text())
    found = {}
    bound = {}                 # local name -> sibling module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 or module.startswith("mgpu_lab.course"):
                base = module.split(".")[-1] if node.level == 0 else module
                if node.level == 0 and module == "mgpu_lab.course" or (node.level == 1 and not module):
                    for a in node.names:            # from . import guard
                        found.setdefault(a.name, [])
                        bound[a.asname or a.name] = a.name
                else:
                    found.setdefault(base, []).extend(
                        a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mgpu_lab.course."):
                    found.setdefault(a.name.split(".")[2], [])
    for node in ast.walk(tree):        # guard._parse: a private name through a module
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found[bound[node.value.id]].append(node.attr)
    return found


def _course_graph():
    modules = {p.stem for p in COURSE.glob("*.py")}
    return {p.stem: {m: names for m, names in _course_imports(p).items() if m in modules}
            for p in COURSE.glob("*.py")}


def test_every_course_module_has_a_side():
    modules = {p.stem for p in COURSE.glob("*.py")}
    placed = set().union(*SIDES.values())
    assert modules <= placed, f"say where these run (SIDES): {sorted(modules - placed)}"


def test_no_import_circle_between_the_course_modules():
    circles = _circles({m: set(deps) - {m} for m, deps in _course_graph().items()})
    assert not circles, f"course modules in an import circle: {circles}"


def test_no_private_name_crosses_course_modules():
    crossing = [f"{m} takes {dep}.{name}" for m, deps in _course_graph().items()
                for dep, names in deps.items() for name in names if dep != m]
    assert not crossing, crossing


def test_the_sandbox_side_never_imports_the_grader_side():
    """What runs beside the learner's code (and what it reads) holds no way to the
    solutions, the judges or the scores: not even an import."""
    graph = _course_graph()
    inside = SIDES["sandbox"] | SIDES["shared"]
    wrong = [f"{m} imports {dep}" for m in sorted(inside) for dep in graph.get(m, {})
             if dep not in inside]
    assert not wrong, wrong


def test_the_runner_is_a_process_no_module_imports():
    """The grader reaches the runner only through its pipe (:mod:`mgpu_lab.course.protocol`
    holds the messages, the placeholder and the command that starts it)."""
    importers = sorted(m for m, deps in _course_graph().items() if "runner" in deps and m != "runner")
    assert not importers, f"modules importing the runner: {importers}"


def _library_sources():
    """``{path relative to mgpu_lab/: syntax tree}`` of the library (the course package aside)."""
    return {str(p.relative_to(LIB)): ast.parse(p.read_text()) for p in sorted(LIB.rglob("*.py"))
            if p.relative_to(LIB).parts[0] != "course"}


def _uses(tree, attribute):
    return any(isinstance(n, ast.Attribute) and n.attr == attribute for n in ast.walk(tree))


def test_one_helper_per_repeated_idea():
    sources = _library_sources()
    # group rank -> global rank: runtime.distributed.global_rank
    assert [f for f, t in sources.items() if _uses(t, "get_global_rank")] == ["runtime/distributed.py"]
    # "is torch.distributed ready": runtime.distributed.require_process_group, one message
    raising = [f for f, t in sources.items() if "not initialised" in ast.unparse(t)]
    assert raising == ["runtime/distributed.py"], raising
    # the one-tensor all-gather and reduce-scatter: parallel/comm.py, looked up at each call
    names = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")
    shims = [f for f, t in sources.items() for n in ast.walk(t)
             if isinstance(n, ast.Attribute) and n.attr in names and ast.unparse(n.value) == "dist"
             or isinstance(n, ast.Constant) and n.value in names and f.startswith("parallel/")]
    assert set(shims) == {"parallel/comm.py"}, shims
