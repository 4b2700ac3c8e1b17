"""What the ranks print, as ``launch()`` shows it: rank 0 live, the others after.

Each rank writes fds 1 and 2 to files. While the run goes on, the parent echoes
rank 0's new bytes (a progress bar's ``\\r`` updates included) to its own
stdout/stderr, every line prefixed ``[rank 0]``; when the ranks have ended it
prints the other ranks' output, rank by rank. The text that ends up in a cell
is the same however the bytes were chunked, so notebook outputs stay
deterministic.
"""
from __future__ import annotations

import codecs
import re
import sys
from typing import Dict, TextIO

from ._workers import output_path

_LINE_BREAK = re.compile(r"([\r\n])")
STREAMS = (("out", "stdout"), ("err", "stderr"))


class _Prefixer:
    """Puts ``[rank R] `` at the start of every line (and after every ``\\r``)."""

    def __init__(self, rank: int):
        self.prefix = f"[rank {rank}] "
        self.at_line_start = True

    def __call__(self, text: str) -> str:
        pieces = []
        for piece in _LINE_BREAK.split(text):
            if not piece:
                continue
            if piece in "\r\n":
                self.at_line_start = True
            elif self.at_line_start:
                pieces.append(self.prefix)
                self.at_line_start = False
            pieces.append(piece)
        return "".join(pieces)

    def close(self) -> str:
        """A newline if the last line was left open."""
        ended = self.at_line_start
        self.at_line_start = True
        return "" if ended else "\n"


class RankOutput:
    """Echo rank ``live_rank``'s output as it is written; print the rest at the end."""

    def __init__(self, workdir: str, nprocs: int, live_rank: int = 0):
        self.workdir, self.nprocs, self.live_rank = workdir, nprocs, live_rank
        self._offsets: Dict[str, int] = {}
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name, _ in STREAMS}
        self._prefixers = {name: _Prefixer(live_rank) for name, _ in STREAMS}

    def pump(self) -> None:
        """Echo whatever the live rank wrote since the last call."""
        for name, stream in STREAMS:
            path = output_path(self.workdir, self.live_rank, name)
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(name, 0))
                    data = f.read()
            except OSError:
                continue  # not created yet
            if data:
                self._offsets[name] = self._offsets.get(name, 0) + len(data)
                text = self._prefixers[name](self._decoders[name].decode(data))
                _write(getattr(sys, stream), text)

    def finish(self) -> None:
        """The live rank's last bytes, then every other rank's output in rank order."""
        self.pump()
        for name, stream_name in STREAMS:
            stream = getattr(sys, stream_name)
            _write(stream, self._prefixers[name](self._decoders[name].decode(b"", final=True))
                   + self._prefixers[name].close())
            for rank in range(self.nprocs):
                if rank != self.live_rank:
                    _write(stream, self.text(rank, name, prefixed=True))

    def text(self, rank: int, name: str, prefixed: bool = False) -> str:
        """Everything rank ``rank`` wrote to ``name`` (``out`` or ``err``)."""
        try:
            with open(output_path(self.workdir, rank, name), encoding="utf-8", errors="replace", newline="") as f:
                text = f.read()
        except OSError:
            return ""
        if not prefixed:
            return text
        prefixer = _Prefixer(rank)
        return prefixer(text) + prefixer.close()


def _write(stream: TextIO, text: str) -> None:
    if text:
        stream.write(text)
        stream.flush()

