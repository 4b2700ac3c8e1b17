"""environment.yml and pyproject.toml name the same packages; CI runs README's test command."""
import re
from conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

CONDA_NAMES = {"pytorch": "torch"}  # conda name -> pip name


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def conda_packages():
    """Package names under ``dependencies:``, less python/pip and the pip section's ``-e .``."""
    text = (ROOT / "environment.yml").read_text().split("dependencies:", 1)[1]
    names = set()
    for spec in re.findall(r"^  - (.+)$", text, flags=re.MULTILINE):  # top-level items only
        name = _name(spec)
        if name not in ("python", "pip", "pip:"):
            names.add(CONDA_NAMES.get(name, name))
    return names


def test_environment_yml_matches_pyproject():
    """The conda environment is the library plus its [course], [lightning], [data] and [test] extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["course"], *extras["lightning"], *extras["data"], *extras["test"]]
    assert conda_packages() == {_name(r) for r in wanted if not r.startswith("mgpu-lab")}


def test_library_needs_no_course_packages():
    """`pip install mgpu-lab` gives the library without Jupyter; the course is an extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert core == {"torch", "cloudpickle"}


def test_ci_runs_the_readme_test_command():
    assert "./run.sh test" in (ROOT / ".ci" / "run").read_text()
    assert "./run.sh test" in (ROOT / "README.md").read_text()


def test_importing_the_library_loads_no_course_machinery():
    """Arrows run one way: `import mgpu_lab` pulls in neither Jupyter, matplotlib nor course/;
    nor torch's DTensor (half a second of every kernel's and rank's start: loaded on first use)."""
    import subprocess
    import sys

    code = ("import sys, mgpu_lab; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('matplotlib', 'nbformat', 'nbclient', 'ipywidgets', 'IPython', 'jupyter_client') "
            "or m.startswith('mgpu_lab.course') or m == 'torch.distributed.tensor'); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"import mgpu_lab loaded {done.stdout.strip()}"


# The public API of /work/shared/DESIGN.md ("Public API (the contract)"), name by name.
DESIGN_PUBLIC_API = {
    "devices", "backend", "rank_device",
    "scatter", "replicate", "parallel_apply", "gather", "DataParallel",
    "DataParallelModel", "DataParallelCriterion",
    "DistEnv", "dist_env", "init_distributed", "cleanup", "is_main_process", "print0", "distributed_loader",
    "launch", "LaunchError",
    "ring_allreduce", "naive_allreduce", "allreduce_bytes", "CommStats", "NaiveDDP", "BucketedDDP",
    "ShardedOptimizer", "FSDP",
    "ColumnParallelLinear", "RowParallelLinear", "PipelineStage", "ScheduleGPipe", "Schedule1F1B",
    "ring_attention", "MoE", "ExpertParallelMoE",
    "autocast_dtype", "LossScaler", "GradientAccumulator",
    "checkpoint", "checkpoint_sequential", "saved_tensor_bytes", "peak_memory",
    "save_checkpoint", "load_checkpoint",
}
# The whole top level, grouped by concept: tests/test_torch_signatures.py checks it.


def test_all_lists_the_public_api_and_every_name_imports():
    import types

    import mgpu_lab

    assert len(mgpu_lab.__all__) == len(set(mgpu_lab.__all__))
    namespace = {}
    exec("from mgpu_lab import *", namespace)
    assert set(mgpu_lab.__all__) <= set(namespace)
    missing = DESIGN_PUBLIC_API - set(mgpu_lab.__all__)
    assert not missing, f"DESIGN.md's public names missing from mgpu_lab.__all__: {sorted(missing)}"
    assert not {name for name in missing if hasattr(mgpu_lab, name)}, "importable but not in __all__"
    public = {name for name, value in vars(mgpu_lab).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public == set(mgpu_lab.__all__), f"public names not in __all__: {sorted(public - set(mgpu_lab.__all__))}"


def test_the_package_docstring_example_imports_what_exists():
    import mgpu_lab

    imports = [line.strip() for line in mgpu_lab.__doc__.splitlines() if line.strip().startswith("from mgpu_lab")]
    assert imports
    for line in imports:
        exec(line, {})
