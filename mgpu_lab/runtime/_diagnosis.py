"""Why a launch failed: which rank is the root cause, how it died, where each rank waited.

Debugging a distributed failure starts from three facts, which the parent of
the ranks can establish and the ranks themselves cannot:

* **who failed first.** The parent records the order in which it sees ranks
  end; the first rank to fail is the root cause, the others usually fail
  because a peer vanished. A rank killed by a signal (SIGSEGV, SIGKILL from the
  out-of-memory killer) or ended by ``os._exit`` leaves no traceback but counts
  the same; when two ranks end in the same instant, the one without a Python
  traceback is the cause (a peer's "connection closed" is a consequence).
* **how it died**: the traceback, or the signal's name and the Python stack
  ``faulthandler`` printed at the crash.
* **where each rank waited**: the innermost ``torch.distributed`` call in its
  traceback, or in the stack a hung rank printed on SIGUSR1. "rank 1 returned
  from fn while rank 0 was still in barrier()" is the classic bug: ranks that
  do not make the same collective calls in the same order.
"""
from __future__ import annotations

import os
import re
import signal
import sysconfig
from typing import Dict, List, Optional, Sequence, Tuple

Frame = Tuple[str, int, str]  # (file, line, function)

_TRACEBACK_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_DUMP_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_DUMP_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):")
_STDLIB = sysconfig.get_paths()["stdlib"]
# gloo: "Timed out waiting 600000ms for recv operation to complete"; NCCL's watchdog, before it
# aborts the process: "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, ...)"
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ ?ms|Watchdog caught collective operation timeout")
SIGNAL_ADVICE = {
    "SIGKILL": "SIGKILL comes from outside the process: the kernel's out-of-memory killer sends it when "
               "memory runs out (see `dmesg`), as does `kill -9`",
    "SIGSEGV": "a segmentation fault: a C/C++/CUDA extension read memory it does not own",
    "SIGABRT": "a C/C++ library aborted (an assertion, or std::terminate)",
    "SIGBUS": "a bus error: often /dev/shm is full (shared memory for DataLoader workers)",
}


def traceback_frames(text: str) -> List[Frame]:
    """The frames of the last Python traceback in ``text``, outermost first."""
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return []
    return [(m[1], int(m[2]), m[3]) for m in map(_TRACEBACK_FRAME.match, text[start:].splitlines()) if m]


def dumped_stacks(text: str) -> List[List[Frame]]:
    """The threads of the last ``faulthandler`` dump in ``text``, each outermost first."""
    dumps: List[List[List[Frame]]] = []
    inside = False
    for line in text.splitlines():
        if _DUMP_HEADER.match(line):
            if not inside:
                dumps.append([])
            dumps[-1].append([])
            inside = True
        elif inside and _DUMP_FRAME.match(line):
            m = _DUMP_FRAME.match(line)
            dumps[-1][-1].append((m[1], int(m[2]), m[3]))
        elif line.strip():
            inside = False
    return [list(reversed(thread)) for thread in dumps[-1]] if dumps else []


def fatal_stack(text: str) -> str:
    """The block ``faulthandler`` printed when a fatal signal hit, or ''."""
    start = text.rfind("Fatal Python error:")
    if start < 0:
        return ""
    lines = []
    for line in text[start:].split("Extension modules:")[0].strip().splitlines():
        lines.append(line)
        if line.rstrip().endswith(" in run_rank"):  # below it: how the rank was started
            break
    return "\n".join(lines)


def _in_torch_distributed(path: str) -> bool:
    return f"{os.sep}torch{os.sep}distributed{os.sep}" in path


def _is_library(path: str) -> bool:
    return path.startswith(_STDLIB) or "site-packages" in path or _in_torch_distributed(path)


def where(frames: Sequence[Frame]) -> Optional[str]:
    """``barrier() (called at train.py:12 in fn)``, or ``train.py:40 in fn`` outside collectives."""
    if not frames:
        return None
    for i, (path, _, func) in enumerate(frames):
        if _in_torch_distributed(path):
            names = [f for p, _, f in frames[i:] if _in_torch_distributed(p)]
            api = next((f for f in names if f != "wrapper" and not f.startswith("_")), names[0])
            if i == 0:
                return f"{api}()"
            caller_path, caller_line, caller_func = frames[i - 1]
            return f"{api}() (called at {os.path.basename(caller_path)}:{caller_line} in {caller_func})"
    user = [f for f in frames if not _is_library(f[0])] or list(frames)
    path, line, func = user[-1]
    return f"{os.path.basename(path)}:{line} in {func}"


def collective_timed_out(text: str) -> bool:
    """Did a rank end because one of its collectives outlived the process group's timeout?
    ``text``: its traceback and stderr."""
    return bool(_COLLECTIVE_TIMEOUT.search(text))


def in_collective(place: Optional[str]) -> bool:
    return bool(place) and place.split(" ")[0].endswith("()")


def hung_rank_place(stderr_text: str) -> Optional[str]:
    """Where a rank that printed its stacks on SIGUSR1 was waiting (its busiest thread)."""
    threads = dumped_stacks(stderr_text)
    for frames in threads:
        if any(_in_torch_distributed(path) for path, _, _ in frames):
            return where(frames)
    main = [t for t in threads if any(func == "run_rank" for _, _, func in t)]
    return where((main or threads or [[]])[0])


def exit_without_result(rank: int, exitcode: Optional[int], stderr_text: str) -> str:
    """The error text of a rank that ended without writing its result."""
    if exitcode is None:
        return f"rank {rank} was still running and was killed"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        advice = SIGNAL_ADVICE.get(name)
        text = f"rank {rank} was killed by signal {name}" + (f" ({advice})" if advice else "")
        stack = fatal_stack(stderr_text)
        return text + (f". Its Python stack at the crash:\n{stack}" if stack else "")
    if exitcode == 0:
        return (f"rank {rank} ended its process (exit code 0) before fn returned: os._exit(0), or "
                "mgpu_lab.cleanup(exit=True), which ends a script; inside launch(), call cleanup() or just return")
    return (f"rank {rank} exited with code {exitcode} without a Python traceback (os._exit(), or a C/C++ "
            f"library that called exit()); see its [rank {rank}] output above")


def root_cause(failed: Sequence[int], seen: Dict[int, int], results: Sequence[dict]) -> int:
    """The failed rank that made the others fail. A rank that raised because a peer went away
    ("Connection closed by peer") is a bystander, never the cause while another rank failed
    otherwise: on a loaded machine a bystander can end before the rank that died. Then the rank
    the parent saw end first; ties: no traceback first, then the rank's own clock."""
    def bystander(r):
        return "type" in results[r] and peer_died(results[r].get("error", ""))
    return min(failed, key=lambda r: (bystander(r), seen.get(r, float("inf")), "type" in results[r],
                                      results[r].get("time", float("inf"))))


def returned_while_waiting(returned: Sequence[int], waits: Dict[int, Optional[str]]) -> str:
    """"rank 1 returned from fn while rank 0 was still in barrier() (...)", or ''."""
    waiting = {r: p for r, p in waits.items() if in_collective(p)}
    if not returned or not waiting:
        return ""
    who = ("rank " if len(returned) == 1 else "ranks ") + ", ".join(str(r) for r in returned)
    lines = [f"{who} returned from fn while rank {r} was still in {p}" for r, p in sorted(waiting.items())]
    return ("\n".join(lines) + ".\nEvery rank must make the same collective calls in the same order: look for a "
            "rank-dependent branch, or ranks running different numbers of steps.\n")


# gloo: "Connection closed by peer [127.0.0.1]:4242", "Connection reset by peer", "Broken pipe";
# NCCL: "remote process exited or there was a network error", a communicator aborted by its watchdog
_DEAD_PEER = re.compile(r"[Cc]onnection (closed|reset) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted|Socket Timeout|connection refused", re.I)


def peer_died(text: str) -> bool:
    """Does a collective's error say that a peer process went away (died, was killed, exited)?"""
    return bool(_DEAD_PEER.search(text))


def collective_failed(what: str, exc: BaseException, group=None, otherwise: str = "") -> RuntimeError:
    """The error to raise when ``what`` (a collective) failed with ``exc``: a peer that died is
    named as such (this rank is a bystander: the cause is in the dead rank's own output);
    any other failure gets ``otherwise`` (advice) appended."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if peer_died(str(exc)):
        try:
            peers = [r for r in dist.get_process_group_ranks(group or dist.group.WORLD) if r != rank]
        except Exception:
            peers = []
        who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}" if peers else "a peer"
        return RuntimeError(f"rank {rank}: {what} failed because {who} of its group died or left ({first}). "
                            "This rank is fine: the cause is in that rank's own output (an exception, or a "
                            "death by signal such as the out-of-memory killer's SIGKILL)")
    return RuntimeError(f"rank {rank}: {what} failed ({first}).{' ' + otherwise if otherwise else ''}")
