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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple


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


def _version(path: Path) -> Optional[str]:
    """The lab version a notebook records (``metadata.mgpu_lab.version``), or None."""
    import json
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8")).get("metadata", {})
        value = (meta.get("mgpu_lab") or {}).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def backup_name(path: Path) -> Path:
    """Where a learner's ``NAME.ipynb`` is kept when a release replaces it: ``NAME.ipynb.bak``
    (``.bak2``, ... when taken): never a notebook the grader or ``labs copy`` would pick up."""
    for n in range(1, 1000):
        candidate = path.with_name(path.name + (".bak" if n == 1 else f".bak{n}"))
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"{path}: 999 backups already")


@dataclass
class Copied:
    """What :func:`copy_labs` did, by notebook name."""
    copied: List[str] = field(default_factory=list)      # new in the folder
    kept: List[str] = field(default_factory=list)        # the learner's, this lab version
    older: Dict[str, Tuple[Optional[str], str]] = field(default_factory=dict)  # kept, older
    replaced: Dict[str, Path] = field(default_factory=dict)   # --update: name -> the backup
    same: List[str] = field(default_factory=list)        # already the release, unchanged

    def __iter__(self):          # ``copied, kept = copy_labs(...)``, as before
        return iter((self.copied, self.kept + list(self.older) + self.same))


def copy_labs(dest: Path, source=None, only: Iterable[str] = (), update: bool = False) -> Copied:
    """Copy the lab notebooks (``only`` those asked for: :func:`select_labs`) into ``dest``.
    A notebook already in ``dest`` is the learner's: kept when it records the release's lab
    version (their work on this lab), or is the release itself; one that records another
    version (a lab changed since) is kept too, unless ``update``: then the release
    replaces it and the learner's file is kept beside it as :func:`backup_name`, never
    lost. What happened to each: :class:`Copied`."""
    if source is None:
        try:
            source = find_root() / "labs"
        except FileNotFoundError:
            source = packaged_labs()
        if source is None:
            raise FileNotFoundError("no labs here: run inside the course checkout or "
                                    "pip install \"mgpu-lab[course]\"")
    dest, done = Path(dest), Copied()
    names = sorted(p.name for p in source.iterdir() if p.name.endswith(".ipynb"))
    chosen = select_labs(names, only)
    dest.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        new, mine = (source / name).read_bytes(), dest / name
        if not mine.exists():
            mine.write_bytes(new)
            done.copied.append(name)
            continue
        if mine.read_bytes() == new:
            done.same.append(name)
            continue
        theirs, release = _version(mine), _version(source / name)
        if theirs == release or release is None:
            done.kept.append(name)
        elif not update:
            done.older[name] = (theirs, release)
        else:
            backup = backup_name(mine)
            os.replace(mine, backup)
            mine.write_bytes(new)
            done.replaced[name] = backup
    return done
