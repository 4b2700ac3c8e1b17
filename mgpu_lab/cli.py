"""The ``mgpu-lab`` command line (also ``python -m mgpu_lab``).

Each subcommand lives in the module of its concept, which defines
``add_parser(subparsers)``; the parser it adds sets ``func(args) -> int``.

    mgpu-lab launch   torchrun, with defaults for this machine   (runtime/torchrun.py)
    mgpu-lab doctor   what this machine can do, and what is off  (runtime/doctor.py)
    mgpu-lab labs     build, execute, copy or check labs          (course/authoring/labs_command.py)
    mgpu-lab grade    score students' notebooks                  (course/classroom/grade.py)
    mgpu-lab export   the grader for Gradescope or PrairieLearn  (course/classroom/export.py)
    mgpu-lab tour     run every solution notebook, headless      (course/authoring/tour.py)
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterable, Optional, Sequence

SUBCOMMANDS = {
    "launch": "runtime.torchrun",
    "doctor": "runtime.doctor",
    "labs": "course.authoring.labs_command",
    "grade": "course.classroom.grade",
    "export": "course.classroom.export",
    "tour": "course.authoring.tour",
}


def build_parser(commands: Iterable[str] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mgpu-lab",
        description="mgpu_lab: learn, then do, multi-GPU training in PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in commands:
        importlib.import_module(f"mgpu_lab.{SUBCOMMANDS[command]}").add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the module of the command asked for (nbformat alone takes seconds
    # to import, and `mgpu-lab launch` should not wait for it); all of them for --help.
    commands = argv[:1] if argv[:1] and argv[0] in SUBCOMMANDS else SUBCOMMANDS
    args = build_parser(commands).parse_args(argv)
    return int(args.func(args) or 0)
