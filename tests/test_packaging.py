"""environment.yml and pyproject.toml name the same packages; CI runs README's test command."""
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert conda_packages() == {_name(r) for r in project["dependencies"]}


def test_ci_runs_the_readme_test_command():
    assert "./run.sh test" in (ROOT / ".ci" / "run").read_text()
    assert "./run.sh test" in (ROOT / "README.md").read_text()
