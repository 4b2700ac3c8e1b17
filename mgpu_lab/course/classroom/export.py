"""``mgpu-lab export``: the course's grader for a platform, in the platform's own form.

    mgpu-lab export gradescope   LAB... -o autograder.zip [--limit 600] [--timeout 120]
    mgpu-lab export prairielearn LAB... -o DIR            [--limit 600] [--image NAME]

Each carries the instructor's solutions of the labs asked for (hidden tests included),
the ``mgpu_lab`` package as this checkout has it (so the platform grades with the same
code), and a :data:`~.platforms.CONFIG` of the limits; the grading itself is
:mod:`.platforms`'s.

- **Gradescope**: a zip with ``setup.sh`` (Python, the CPU torch wheel, the package with
  its ``[course]`` extra into ``/opt/mgpu-lab``, and bubblewrap where the image has it) and
  ``run_autograder``; upload it as the assignment's autograder.
- **PrairieLearn**: ``DIR/<lab>/``, one externally graded question per lab (``info.json``
  with ``externalGradingOptions``, ``question.html``, ``tests/`` with the solutions and
  the entrypoint ``run.sh``), and ``DIR/image/``, the Docker image's recipe (push it and
  name it with ``--image``).

``--limit`` is the platform's time limit for one submission (Gradescope's default and
PrairieLearn's maximum: 600 s); the notebook gets it less a reserve in all, each cell
``--timeout`` at most.
"""
from __future__ import annotations

import json
import shutil
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Dict, List

from ..notebook.layout import course_dir, select_labs
from .platforms import CONFIG, RESERVE

PACKAGE = "mgpu_lab_package"
# Memory: Gradescope's default container has 768 MiB for the grader, its judge and the
# kernel together. Every lab's solution grades to full marks in it (each lab's measured peak:
# docs/INSTRUCTORS.md, "Memory"; tests/test_mutants.py grades each in a 768 MiB cgroup). A lab
# that needed more would be named here with what it needs (MiB), and the export would say so;
# none does (lab 03's torchrun check forks its agent and ranks from the kernel: 636 MiB).
GRADESCOPE_MIB = 768
NEEDS_MIB: Dict[str, int] = {}
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (written by
# `mgpu-lab export gradescope`): Python, the CPU build of torch, mgpu_lab with its [course]
# extra in /opt/mgpu-lab, and bubblewrap, the sandbox, where the image allows it (without
# it run_autograder runs the learner's kernel as user nobody, who cannot read source/).
set -euxo pipefail
SOURCE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || true
apt-get install -y -qq python3 python3-venv python3-pip
apt-get install -y -qq bubblewrap || echo "setup.sh: no bubblewrap: kernels will run as nobody"
python3 -m venv /opt/mgpu-lab
/opt/mgpu-lab/bin/pip install --quiet --upgrade pip
/opt/mgpu-lab/bin/pip install --quiet "{torch}" --index-url {index}
/opt/mgpu-lab/bin/pip install --quiet "$SOURCE/{package}[course]"
/opt/mgpu-lab/bin/python -c "import mgpu_lab.course.classroom.platforms, torch; print(torch.__version__)"
chmod 0700 "$SOURCE"
"""
RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission (written by `mgpu-lab export gradescope`):
# grades submission/*.ipynb with the solutions in source/, writes results/results.json.
# {memory}
export AUTOGRADER_ROOT="${AUTOGRADER_ROOT:-/autograder}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${MGPU_LAB_PYTHON:-/opt/mgpu-lab/bin/python}" -m mgpu_lab.course.classroom.platforms gradescope \\
    --root "$AUTOGRADER_ROOT"
"""
RUN_SH = """#!/usr/bin/env bash
# PrairieLearn's entrypoint (written by `mgpu-lab export prairielearn`): grades
# student/*.ipynb with the solutions in tests/, writes results/results.json.
export GRADE_ROOT="${GRADE_ROOT:-/grade}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${MGPU_LAB_PYTHON:-python3}" -m mgpu_lab.course.classroom.platforms prairielearn --root "$GRADE_ROOT"
"""
DOCKERFILE = """# The image PrairieLearn grades in (written by `mgpu-lab export prairielearn`):
#   docker build -t {image} . && docker push {image}
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \\
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "{torch}" --index-url {index}
COPY {package} /opt/{package}
RUN pip install --no-cache-dir "/opt/{package}[course]"
ENV MGPU_LAB_PYTHON=/usr/local/bin/python
"""
QUESTION_HTML = """<pl-question-panel>
  <p>{title}: upload your notebook <code>{lab}.ipynb</code>. It is graded in a fresh kernel,
  each exercise by the checks of the lab (hidden ones too).</p>
  <pl-file-upload file-names="{lab}.ipynb"></pl-file-upload>
</pl-question-panel>
<pl-submission-panel>
  <pl-external-grader-results></pl-external-grader-results>
  <pl-file-preview></pl-file-preview>
</pl-submission-panel>
"""


def package_tree(dest: Path) -> Path:
    """The ``mgpu_lab`` package as installed here, with a ``pyproject.toml`` that installs it
    with its ``[course]`` extra (its dependencies as this installation declares them)."""
    import mgpu_lab
    from importlib import metadata
    src = Path(mgpu_lab.__file__).resolve().parent
    shutil.copytree(src, dest / "mgpu_lab", ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "_labs"))
    packages = sorted("mgpu_lab" + ("." + ".".join(p.relative_to(dest / "mgpu_lab").parts)
                                    if p != dest / "mgpu_lab" else "")
                      for p in (dest / "mgpu_lab").rglob("*") if (p / "__init__.py").is_file())
    packages.insert(0, "mgpu_lab")
    try:
        version = metadata.version("mgpu-lab")
        requires = metadata.requires("mgpu-lab") or []
    except metadata.PackageNotFoundError:
        version, requires = "0", ["torch>=2.4", "cloudpickle>=2.2"]
    core = [r for r in requires if ";" not in r]
    course = [r.split(";")[0].strip() for r in requires if 'extra == "course"' in r]
    data = sorted(str(p.relative_to(dest / "mgpu_lab" / "training"))
                  for p in (dest / "mgpu_lab" / "training").glob("*.txt"))
    (dest / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "mgpu-lab"\nversion = "{version}"\nrequires-python = ">=3.9"\n'
        f"dependencies = {json.dumps(core)}\n\n[project.optional-dependencies]\n"
        f"course = {json.dumps(course)}\n\n[tool.setuptools]\n"
        f"packages = {json.dumps(sorted(set(packages)))}\n\n[tool.setuptools.package-data]\n"
        f'"mgpu_lab.training" = {json.dumps(data)}\n', encoding="utf-8")
    return dest


def torch_spec() -> str:
    import torch
    return f"torch=={torch.__version__.split('+')[0]}"


def config_for(labs: List[str], args) -> dict:
    return {"labs": labs, "timeout": args.timeout, "limit": args.limit, "memory": args.memory,
            "visibility": args.visibility, "policy": args.policy, "run_as": args.run_as,
            "sandbox": "off" if args.no_sandbox else "auto"}


def chosen(args) -> Dict[str, Path]:
    """``{lab id: its solution}`` for the labs asked for."""
    solutions = course_dir(args, "solutions")
    names = sorted(p.name for p in solutions.glob("*.ipynb"))
    return {name[:-6]: solutions / name for name in select_labs(names, args.labs)}


def export_gradescope(labs: Dict[str, Path], out: Path, args) -> List[str]:
    """Write ``out`` (the autograder zip); its entries."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        package_tree(tmp / PACKAGE)
        files = {"setup.sh": SETUP_SH.format(torch=args.torch or torch_spec(), index=CPU_INDEX,
                                             package=PACKAGE),
                 "run_autograder": RUN_AUTOGRADER.replace("{memory}", memory_line(labs)),
                 CONFIG: json.dumps(config_for(sorted(labs), args), indent=2) + "\n"}
        out.parent.mkdir(parents=True, exist_ok=True)
        names = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            for name, text in files.items():
                _add(z, name, text.encode("utf-8"), 0o755 if name != CONFIG else 0o644)
                names.append(name)
            for lab, path in labs.items():
                _add(z, f"solutions/{path.name}", path.read_bytes(), 0o600)
                names.append(f"solutions/{path.name}")
            for p in sorted((tmp / PACKAGE).rglob("*")):
                if p.is_file():
                    name = p.relative_to(tmp).as_posix()
                    _add(z, name, p.read_bytes(), 0o644)
                    names.append(name)
    return names


def memory_needed(labs) -> int:
    """MiB of memory the container needs to grade every one of ``labs`` (lab ids)."""
    return max([GRADESCOPE_MIB] + [NEEDS_MIB.get(lab, 0) for lab in labs])


def memory_line(labs) -> str:
    """What the export says of memory: the labs fit Gradescope's default, or what they need."""
    need = memory_needed(labs)
    if need <= GRADESCOPE_MIB:
        return (f"memory: every lab here grades within Gradescope's default {GRADESCOPE_MIB} MiB "
                "(grader, judge and kernel together; docs/INSTRUCTORS.md, Memory); a kernel "
                "killed for memory says \"out of memory (limit N MiB)\"")
    big = ", ".join(f"{lab} {NEEDS_MIB[lab]} MiB" for lab in sorted(labs) if lab in NEEDS_MIB)
    return (f"memory: give the autograder at least {need} MiB (Gradescope's default is "
            f"{GRADESCOPE_MIB} MiB: {big}; docs/INSTRUCTORS.md, Memory); a kernel killed for "
            "memory says \"out of memory (limit N MiB)\"")


def _add(z: zipfile.ZipFile, name: str, data: bytes, mode: int) -> None:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
    info.external_attr = (0o100000 | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def export_prairielearn(labs: Dict[str, Path], out: Path, args) -> List[Path]:
    """Write ``out/<lab>/`` per lab and ``out/image/``; the question folders."""
    import nbformat
    from ..notebook.exercises import lab_version
    image = args.image or "mgpu-lab-grader:latest"
    (out / "image").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "image" / PACKAGE, ignore_errors=True)
    package_tree(out / "image" / PACKAGE)
    (out / "image" / "Dockerfile").write_text(DOCKERFILE.format(
        image=image, torch=args.torch or torch_spec(), index=CPU_INDEX, package=PACKAGE))
    questions = []
    for lab, path in labs.items():
        nb = nbformat.read(path, as_version=4)
        heading = next((line.lstrip("# ").strip() for line in nb.cells[0].source.splitlines()
                        if line.startswith("#")), lab) if nb.cells else lab
        folder = out / lab
        tests = folder / "tests"
        shutil.rmtree(tests / "solutions", ignore_errors=True)
        (tests / "solutions").mkdir(parents=True)
        shutil.copy(path, tests / "solutions" / path.name)
        (tests / CONFIG).write_text(json.dumps(config_for([lab], args), indent=2) + "\n")
        (tests / "run.sh").write_text(RUN_SH)
        (tests / "run.sh").chmod(0o755)
        info = {"uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"mgpu-lab/{lab}")),
                "title": heading, "topic": "mgpu_lab", "tags": ["mgpu-lab",
                                                                f"version-{lab_version(nb)}"],
                "type": "v3", "singleVariant": True, "gradingMethod": "External",
                "externalGradingOptions": {"enabled": True, "image": image,
                                           "entrypoint": "/grade/tests/run.sh",
                                           "timeout": int(args.limit)}}
        (folder / "info.json").write_text(json.dumps(info, indent=2) + "\n")
        (folder / "question.html").write_text(QUESTION_HTML.format(title=heading, lab=lab))
        questions.append(folder)
    return questions


def _cmd_export(args) -> int:
    def usage(message: str) -> int:
        print(f"mgpu-lab export {args.platform}: {message}", file=sys.stderr)
        return 2
    if args.timeout <= 0 or args.limit <= RESERVE + 15:
        return usage(f"--timeout must be positive and --limit above {RESERVE + 15:g} s")
    if args.platform == "prairielearn" and args.limit > 600:
        return usage("PrairieLearn's timeout is 600 s at most")
    try:
        labs = chosen(args)
    except FileNotFoundError as err:
        return usage(f"{err}; pass --root DIR or --solutions DIR")
    out = Path(args.output)
    if args.platform == "gradescope":
        names = export_gradescope(labs, out, args)
        print(f"wrote {out} ({len(names)} files; labs {', '.join(labs)}): upload it as the "
              f"assignment's autograder (timeout {args.limit:g} s)\n{memory_line(labs)}")
    else:
        folders = export_prairielearn(labs, out, args)
        print(f"wrote {len(folders)} question(s) in {out}: copy {', '.join(f.name for f in folders)}"
              f" into your course's questions/, build and push {out / 'image'} as "
              f"{args.image or 'mgpu-lab-grader:latest'}")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="the grader for Gradescope or PrairieLearn",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("platform", choices=["gradescope", "prairielearn"])
    p.add_argument("labs", nargs="+", metavar="LAB", help="labs (number or id)")
    p.add_argument("-o", "--output", required=True,
                   help="the zip (gradescope) or the folder (prairielearn) to write")
    p.add_argument("--root", help="the course checkout (default: found from cwd)")
    p.add_argument("--solutions", help="instructor notebooks (default: ROOT/solutions)")
    p.add_argument("--limit", type=float, default=600.0,
                   help="the platform's time limit per submission, seconds (600)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (120)")
    p.add_argument("--memory", type=float, help="GiB per notebook's sandbox (default: the "
                   "container's memory, at most 8)")
    p.add_argument("--visibility", default="visible",
                   choices=["visible", "hidden", "after_due_date", "after_published"],
                   help="Gradescope: when students see the tests (visible)")
    p.add_argument("--policy", choices=["best", "latest"], default="best",
                   help="of several notebooks of one lab in a submission, which counts")
    p.add_argument("--run-as", default="nobody",
                   help="where no sandbox can be made: the user the kernel runs as (nobody)")
    p.add_argument("--no-sandbox", action="store_true", help="grade with no isolation at all "
                   "(trusted notebooks only: a submission could read the solutions)")
    p.add_argument("--torch", help="the torch to install (default: this one's version, CPU build)")
    p.add_argument("--image", help="PrairieLearn: the grading image's name")
    p.set_defaults(func=_cmd_export)
