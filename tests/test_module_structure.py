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


def test_no_import_circle_between_the_parallel_modules():
    graph = {p.stem: _local_imports(p) for p in PARALLEL.glob("*.py")}

    def reaches(start, target, seen):
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False
    circles = sorted(m for m in graph if reaches(m, m, {m}))
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
