"""Where the course lives: the checkout we run in, or the labs installed with the package.

Course commands (``labs build/execute/copy``, ``tour``, ``grade``) find
``labs/`` and ``solutions/`` by walking up from the current folder, or take
``--root``; never from the package's install path. The wheel ships the labs as
``mgpu_lab/_labs`` (pyproject.toml maps it to ``labs/``), so that
``pip install "mgpu-lab[course]"`` then ``mgpu-lab labs copy DIR`` gives a
learner the labs without a clone.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List


def find_root(start=None) -> Path:
    """The checkout we are in: the nearest folder, from ``start`` (cwd) up, with
    ``solutions/`` or ``labs/`` in it. Raises FileNotFoundError saying what to do."""
    here = Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        if (folder / "solutions").is_dir() or (folder / "labs").is_dir():
            return folder
    raise FileNotFoundError(f"no solutions/ or labs/ folder in {here} or above: run this "
                            "inside the course checkout, or pass --root DIR")


def course_dir(args, name: str) -> Path:
    """``args.<name>`` when given, else ``<root>/<name>`` (``--root`` or :func:`find_root`)."""
    given = getattr(args, name, None)
    if given:
        return Path(given)
    return (Path(args.root) if getattr(args, "root", None) else find_root()) / name


def packaged_labs():
    """The labs installed with the package (``mgpu_lab/_labs`` in the wheel), or None."""
    import mgpu_lab
    folder = Path(mgpu_lab.__file__).resolve().parent / "_labs"
    if not folder.is_dir():
        try:  # an editable install maps mgpu_lab._labs to the checkout's labs/
            from importlib.resources import files
            folder = files("mgpu_lab._labs")
        except (ImportError, TypeError, ValueError):
            return None
    try:
        return folder if any(p.name.endswith(".ipynb") for p in folder.iterdir()) else None
    except OSError:
        return None


def copy_labs(dest: Path, source=None) -> List[str]:
    """Copy the lab notebooks into ``dest`` (never over an existing file); their names."""
    if source is None:
        try:
            source = find_root() / "labs"
        except FileNotFoundError:
            source = packaged_labs()
        if source is None:
            raise FileNotFoundError("no labs here: run inside the course checkout or "
                                    "pip install \"mgpu-lab[course]\"")
    dest = Path(dest)
    notebooks = sorted((p for p in source.iterdir() if p.name.endswith(".ipynb")),
                       key=lambda p: p.name)
    clash = [p.name for p in notebooks if (dest / p.name).exists()]
    if clash:
        raise FileExistsError(f"{dest} already has {', '.join(clash)}: "
                              "choose an empty folder (your work is never overwritten)")
    dest.mkdir(parents=True, exist_ok=True)
    for p in notebooks:
        (dest / p.name).write_bytes(p.read_bytes())
    return [p.name for p in notebooks]
