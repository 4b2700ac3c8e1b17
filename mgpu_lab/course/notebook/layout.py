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
from typing import Iterable, List, Tuple


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


def select_labs(names: List[str], wanted: Iterable[str] = ()) -> List[str]:
    """The notebook names of ``names`` that ``wanted`` asks for: a lab's number (``06``),
    id (``06_gradient_accumulation``) or file name; all of them when ``wanted`` is empty.
    FileNotFoundError names what matches nothing."""
    wanted = list(wanted)
    if not wanted:
        return list(names)
    picked, unknown = [], []
    for want in wanted:
        stem = want[:-6] if want.endswith(".ipynb") else want
        found = [n for n in names if n[:-6] == stem or n.split("_")[0] == stem]
        unknown += [] if found else [want]
        picked += [n for n in found if n not in picked]
    if unknown:
        raise FileNotFoundError(f"no lab {', '.join(unknown)} (there are: "
                                f"{', '.join(n[:-6] for n in names)})")
    return sorted(picked)


def copy_labs(dest: Path, source=None, only: Iterable[str] = ()) -> Tuple[List[str], List[str]]:
    """Copy the lab notebooks (``only`` those asked for: :func:`select_labs`) into ``dest``;
    ``(names copied, names kept)``: a notebook already in ``dest`` is the learner's work,
    never overwritten, so a folder that has some labs gets the others."""
    if source is None:
        try:
            source = find_root() / "labs"
        except FileNotFoundError:
            source = packaged_labs()
        if source is None:
            raise FileNotFoundError("no labs here: run inside the course checkout or "
                                    "pip install \"mgpu-lab[course]\"")
    dest = Path(dest)
    names = sorted(p.name for p in source.iterdir() if p.name.endswith(".ipynb"))
    chosen = select_labs(names, only)
    kept = [n for n in chosen if (dest / n).exists()]
    dest.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        if name not in kept:
            (dest / name).write_bytes((source / name).read_bytes())
    return [n for n in chosen if n not in kept], kept
