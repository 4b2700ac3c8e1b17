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
    """The conda environment is the library plus its [course], [lightning] and [test] extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["course"], *extras["lightning"], *extras["test"]]
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
    """Arrows run one way: `import mgpu_lab` pulls in neither Jupyter, matplotlib nor course/."""
    import subprocess
    import sys

    code = ("import sys, mgpu_lab; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('matplotlib', 'nbformat', 'nbclient', 'ipywidgets', 'IPython', 'jupyter_client') "
            "or m.startswith('mgpu_lab.course')); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"import mgpu_lab loaded {done.stdout.strip()}"
