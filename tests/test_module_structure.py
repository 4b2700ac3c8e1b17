"""What the library's structure promises, read from its source: one way to walk a
nested structure (torch.utils._pytree), one flatten/unflatten of tensor lists
(torch._utils), and no import circle between the modules of ``parallel/``."""
import ast
import re
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
# The wings of course/ and the wings each one may import: the notebook model at the bottom,
# the grading engine on it, a class and the author's commands on top (neither of those two
# imports the other).
WINGS = {
    "notebook": set(),
    "grading": {"notebook"},
    "classroom": {"grading", "notebook"},
    "authoring": {"grading", "notebook"},
}
# Where each module of course/ runs. The sandbox side runs with the learner's code (the
# runner and its kernels); shared modules are read by both sides; the grader side holds
# the solutions, the judges and the scores, and the sandbox side must never import it.
# A module is named by its path under course/ ("grading.runner"; a package's own file
# "grading.__init__": importing the runner runs it).
SIDES = {
    "sandbox": {"grading.runner", "grading.kernel", "grading.sandbox", "grading.warm_kernel",
                "grading.snapshot"},
    "shared": {"__init__", "notebook.__init__", "grading.__init__", "grading.protocol",
               "grading.guard", "notebook.cells", "notebook.graded_cell"},
    "grader": {"grading.grader", "grading.session", "grading.scoring", "grading.submission",
               "grading.tamper", "grading.judge", "grading.judge_pool", "grading.cases", "grading.hidden",
               "grading.misconceptions",
               "notebook.notebooks", "notebook.layout", "notebook.exercises",
               "classroom.__init__", "classroom.grade", "classroom.report", "classroom.gradebook",
               "classroom.handins", "classroom.lms", "classroom.platforms", "classroom.export",
               "authoring.__init__", "authoring.labs_command", "authoring.tour",
               "authoring.gpu_pass"},
}


def _module_name(path) -> str:
    return ".".join(path.relative_to(COURSE).with_suffix("").parts)


def _course_modules():
    return {_module_name(p): p for p in sorted(COURSE.rglob("*.py"))}


def _course_imports(path, modules, strings=False):
    """``[(line, course module it imports, [private names taken from it])]`` of a course
    module: relative or absolute imports anywhere in the file (function-local ones
    included); with ``strings``, also a ``mgpu_lab.course...`` module named in a string that
    is not a docstring (a process started by its name: ``python -m``, ``runpy``)."""
    name = _module_name(path)
    package = ["mgpu_lab", "course", *name.split(".")[:-1]]

    def module_of(parts):          # ["mgpu_lab", "course", "grading", "judge"] -> "grading.judge"
        rel = ".".join(parts[2:])
        return rel if rel in modules else (f"{rel}.__init__" if rel else "__init__")

    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    found, bound = [], {}          # bound: local name -> course module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else [])
            base += (node.module or "").split(".") if node.module else []
            if base[:2] != ["mgpu_lab", "course"]:
                continue
            for a in node.names:   # from ..notebook import cells: the module cells
                named = ".".join([*base[2:], a.name])
                if named in modules or f"{named}.__init__" in modules:
                    target = named if named in modules else f"{named}.__init__"
                    found.append((node.lineno, target, []))
                    bound[a.asname or a.name] = target
                else:
                    private = [a.name] if a.name.startswith("_") and not a.name.startswith("__") else []
                    found.append((node.lineno, module_of(base), private))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mgpu_lab.course"):
                    found.append((node.lineno, module_of(a.name.split(".")), []))
        elif (strings and isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings):
            for dotted in re.findall(r"\bmgpu_lab\.course\.[\w.]*\w", node.value):
                parts = dotted.split(".")
                while len(parts) > 2 and ".".join(parts[2:]) not in modules:
                    parts.pop()
                found.append((node.lineno, module_of(parts), []))
    for node in ast.walk(tree):        # guard._parse: a private name through a module
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append((node.lineno, bound[node.value.id], [node.attr]))
    return found


def _course_graph():
    """``{course module: {course module it imports: [private names taken from it]}}``."""
    modules = _course_modules()
    graph = {}
    for name, path in modules.items():
        deps = graph.setdefault(name, {})
        for _, target, private in _course_imports(path, modules):
            deps.setdefault(target, []).extend(private)
    return graph


def test_course_modules_sit_in_their_wings():
    """course/ holds its ``__init__.py`` (the pytest plugin) and the wings' folders, nothing
    flat; each wing a package whose ``__init__.py`` says what it is for and imports nothing
    (importing any module of a wing runs it)."""
    flat = sorted(p.name for p in COURSE.glob("*.py") if p.name != "__init__.py")
    assert not flat, f"put these in a wing ({', '.join(WINGS)}): {flat}"
    folders = {p.name for p in COURSE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WINGS), f"course/'s folders {sorted(folders)} are not the wings {sorted(WINGS)}"
    deep = sorted(str(p.relative_to(COURSE)) for p in COURSE.rglob("*.py") if len(p.relative_to(COURSE).parts) > 2)
    assert not deep, f"one level of wings: {deep}"
    for wing in WINGS:
        init = COURSE / wing / "__init__.py"
        assert init.is_file(), f"{wing}/ has no __init__.py"
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{wing}/__init__.py: say what the wing is for"
        imports = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not imports, f"{wing}/__init__.py imports (lines {imports}): keep it a docstring"


def test_course_imports_run_one_way_between_the_wings():
    """notebook <- grading <- classroom, authoring: an import (or a module started by its
    name) into another wing goes only where :data:`WINGS` says."""
    modules = _course_modules()
    wrong = []
    for name, path in modules.items():
        wing = name.split(".")[0] if "." in name else None
        for line, target, _ in _course_imports(path, modules, strings=True):
            to = target.split(".")[0] if "." in target else None
            if wing is None or to is None:
                if wing != to:
                    wrong.append(f"course/{path.relative_to(COURSE)} line {line} imports {target} "
                                 "(the plugin, course/__init__.py, and the wings import nothing of each other)")
            elif to != wing and to not in WINGS[wing]:
                may = ", ".join(sorted(WINGS[wing])) or "no other wing"
                wrong.append(f"course/{path.relative_to(COURSE)} line {line} imports {target}: "
                             f"{wing} may import {may}")
    assert not wrong, "\n".join(wrong)


def test_every_course_module_has_a_side():
    modules = set(_course_modules())
    placed = set().union(*SIDES.values())
    assert modules <= placed, f"say where these run (SIDES): {sorted(modules - placed)}"
    assert placed <= modules, f"SIDES names modules that are gone: {sorted(placed - modules)}"


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
    """The grader reaches the runner only through its pipe (:mod:`mgpu_lab.course.grading.protocol`
    holds the messages, the placeholder and the command that starts it)."""
    importers = sorted(m for m, deps in _course_graph().items()
                       if "grading.runner" in deps and m != "grading.runner")
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
