"""No solution notebook touches CUDA in its kernel before its last launch(), unless it says why.

``launch()`` forks the kernel while that is safe (milliseconds); once the kernel
touched CUDA it must start fresh processes instead (seconds the first time). So
a lab keeps CUDA out of its kernel until its last ``launch()``, or a comment in
the cell says why it does not: ``# CUDA in the kernel: <reason>``.

The check reads the code (it runs nothing): calls made by the kernel itself, i.e.
outside ``def`` and ``lambda`` bodies (those run in the ranks), of ``x.cuda()``,
``torch.cuda.<anything but device_count / is_initialized / is_available>`` and any
call given a ``"cuda..."`` string.
"""
import ast

import nbformat
import pytest

from conftest import ROOT

# device_count asks NVML: no context, no poisoned fork. is_available creates no context either, but it
# initialises the driver and marks later forks "bad": launch() notices (a forked probe) and starts fresh
# processes then, so it is allowed here; labs prefer device_count() to keep launch() on the fast fork.
SAFE = {"device_count", "is_initialized", "is_available"}
REASON = "# CUDA in the kernel:"


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _kernel_calls(tree):
    """Call nodes the kernel itself runs: not inside def, lambda or class bodies."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(node.decorator_list if hasattr(node, "decorator_list") else [])
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def cuda_calls(source: str):
    """The CUDA-touching calls of one cell's kernel code, as text."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    found = []
    for call in _kernel_calls(ast.parse(code)):
        name = _dotted(call.func)
        strings = [a.value for a in list(call.args) + [k.value for k in call.keywords]
                   if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        is_dot_cuda = isinstance(call.func, ast.Attribute) and call.func.attr == "cuda"  # x.cuda()
        if (name.startswith("torch.cuda.") and name.split(".")[2] not in SAFE) or is_dot_cuda \
                or any(s.startswith("cuda") for s in strings):
            found.append(ast.get_source_segment(code, call))
    return found


def violations(nb):
    code = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    launches = [i for i, src in code if "launch(" in src]
    if not launches:
        return []
    return [(i, call) for i, src in code if i < launches[-1] and REASON not in src for call in cuda_calls(src)]


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.name)
def test_no_cuda_in_the_kernel_before_the_last_launch(path):
    assert violations(nbformat.read(path, as_version=4)) == [], (
        f"{path.name}: these cells touch CUDA in the kernel before its last launch(), which then cannot fork. "
        f"Move the call into the launched function, use torch.cuda.device_count(), or say why in the cell "
        f"with '{REASON} <reason>'.")


def test_the_check_finds_what_it_should():
    cells = [
        "import torch\nn = torch.cuda.device_count()",            # safe
        "x = torch.zeros(3).cuda()\ndef f():\n    torch.cuda.synchronize()",  # .cuda() in the kernel
        "ok = torch.cuda.is_available()\nname = torch.cuda.get_device_name(0)",  # the second creates a context
        "y = torch.ones(1).to('cuda:0')",                          # a "cuda" string
        f"{REASON} measures the parent's own GPU memory\nz = torch.cuda.memory_allocated()",
        "from mgpu_lab import launch\nlaunch(lambda: torch.cuda.synchronize())",
        "w = torch.zeros(1).cuda()",                               # after the last launch: fine
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    assert violations(nb) == [(1, "torch.zeros(3).cuda()"), (2, "torch.cuda.get_device_name(0)"),
                              (3, "torch.ones(1).to('cuda:0')")]
