"""The ``mgpu-lab`` command line (also ``python -m mgpu_lab``).

Each subcommand lives in the module of its concept, which defines
``add_parser(subparsers)``; the parser it adds sets ``func(args) -> int``.

    mgpu-lab launch   torchrun, with defaults for this machine   (torchrun.py)
    mgpu-lab doctor   what this machine can do, and what is off  (doctor.py)
    mgpu-lab labs     build labs/ from solutions/, or re-execute (notebooks.py)
    mgpu-lab grade    score students' notebooks                  (grader.py)
    mgpu-lab tour     run every solution notebook, headless      (tour.py)
"""
from __future__ import annotations

import argparse
import importlib
from typing import Optional, Sequence

SUBCOMMAND_MODULES = ("torchrun", "doctor", "notebooks", "grader", "tour")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mgpu-lab",
        description="mgpu_lab: learn, then do, multi-GPU training in PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"mgpu_lab.{name}").add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
