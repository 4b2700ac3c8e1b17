"""A small real text that ships with the package, to train a tiny language model on.

``course_text()`` is this course's own prose: the markdown of labs 00-12, in order,
written in plain ASCII (a dash for an em dash, ``x`` for a multiplication sign), about
64 KB. It ships as ``course_text.txt`` next to this module, so nothing is downloaded
and every run (a laptop, a grader's sandbox, a GPU node) reads the same bytes.
``build_course_text(folder)`` is how the file was made (kept fixed afterwards, so that
a lab's stored numbers do not move when a lab's wording does).

Characters are the tokens (nanoGPT's shakespeare_char): ``CharTokenizer(text)`` maps the
distinct characters of the text to 0..V-1, ``encode``/``decode`` go between strings and
tensors of ids.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List

import torch

FILE = Path(__file__).with_name("course_text.txt")
_ASCII = {"\u2014": "-", "\u2013": "-", "\u00d7": "x", "\u2192": "->", "\u00b7": "*", "\u2026": "...",
          "\u221a": "sqrt", "\u2212": "-", "\u2264": "<=", "\u2265": ">=", "\u2248": "~", "\u21d2": "=>",
          "\u00b2": "^2", "\u2019": "'", "\u201c": '"', "\u201d": '"'}


def course_text() -> str:
    """The text (a str of about 64 KB)."""
    return FILE.read_text(encoding="ascii")


def build_course_text(folder: str, limit: int = 64_000) -> str:
    """The markdown cells of the notebooks in ``folder`` (sorted by name), in ASCII, cut at the
    last paragraph that fits in ``limit`` characters."""
    parts: List[str] = []
    for path in sorted(Path(folder).glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        parts += ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    text = "\n\n".join(parts)
    for a, b in _ASCII.items():
        text = text.replace(a, b)
    text = "".join(ch for ch in text if ch == "\n" or 32 <= ord(ch) < 127)
    return text[: text.rfind("\n\n", 0, limit)] + "\n"


class CharTokenizer:
    """Characters as tokens: ``vocab`` is the sorted distinct characters of ``text``."""

    def __init__(self, text: str):
        self.vocab = sorted(set(text))
        self._index = {ch: i for i, ch in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        missing = sorted(set(text) - set(self._index))
        if missing:
            raise ValueError(f"characters not in the vocabulary: {missing[:10]}")
        return torch.tensor([self._index[ch] for ch in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


if __name__ == "__main__":  # python -m mgpu_lab.training.corpus labs/  (rewrites the shipped file)
    import sys
    FILE.write_text(build_course_text(sys.argv[1] if len(sys.argv) > 1 else os.path.join("labs")), encoding="ascii")
