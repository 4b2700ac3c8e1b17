"""Run a notebook cell by cell in a fresh kernel, under time limits.

The grader, ``mgpu-lab labs execute`` and the tour all run notebooks here, so a
solution is executed exactly as a submission is graded:

- the kernel is this very Python (``sys.executable``), not whatever the
  ``python3`` kernel spec points at, and its working folder is the notebook's;
- each cell has ``timeout`` seconds (less where a check's metadata says so:
  :func:`cell_limit`); then the kernel is interrupted (the cell gets "Timeout") and,
  if it does not answer within 3 s, killed;
- when the kernel dies (``os._exit``, a segfault, out of memory) or was killed,
  a fresh kernel re-runs every earlier cell once (except cells that hung or
  crashed) to rebuild the state, and the run goes on after the bad cell; after
  ``MAX_RESTARTS`` restarts the remaining cells get "DeadKernel";
- a cell that failed (not by a timeout: its kernel died, a rank of its ``launch()``) while
  the OOM killer killed a process of the kernel's cgroup (``oom_kills()``, a counter read
  before and after the cell) gets "OutOfMemory" instead (one that raised nothing, the
  message :data:`OOM_MESSAGE`: a process it started was killed);
- ``total_timeout`` bounds the whole notebook; cells past it get "TotalTimeout".

``before(client, index, cell)`` and ``after(client, index, cell, result)`` (async)
run around each cell's first execution (not around replays): the grader's
runner fills a graded cell's source in ``before`` and sets or lifts the
"must not call" guards (:mod:`mgpu_lab.course.grading.guard`) with :func:`silent`.

What it costs: one kernel start (about two seconds of CPU, nearly all imports) per
notebook and per restart, and the replay of the earlier cells after a restart. The
grader's runner has its kernels forked warm instead (``start_kernel``: :mod:`.warm_kernel`).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from queue import Empty
from time import monotonic, sleep
from typing import Dict, List, Optional, Tuple

MAX_RESTARTS = 3
CURRENT_ENV = "mgpu-lab-current-env"  # the kernel of this very Python
TIMEOUT_REPLY = {"ename": "Timeout", "traceback": [],
                 "evalue": "the cell ran past its time limit and was interrupted"}
# A traceback entry of IPython's for code of a cell: "Cell In[7], line 3" (ANSI colours
# between the words). A graded cell run without history shows the count the next cell gets.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL_FRAME = re.compile(r"^Cell In\[(\d+)\], line (\d+)")


@dataclass
class CellResult:
    index: int                      # position in nb.cells
    error: Optional[str] = None     # exception name, "Timeout", "DeadKernel", ...
    message: str = ""
    seconds: float = 0.0
    expected_error: bool = False    # tagged raises-exception
    died: bool = False              # the kernel died running it (DeadKernel, or OutOfMemory)
    frames: List[Tuple[int, int]] = field(default_factory=list)  # (cell index, line), outermost first


def cell_frames(traceback: List[str], counts: Dict[int, int]) -> List[Tuple[int, int]]:
    """The frames of a kernel's traceback that are in notebook cells, as (cell index,
    line); ``counts`` maps execution counts to cell indices (frames of code that is
    not a cell, a library's or an ``exec``'d string's, are left out)."""
    frames = []
    for entry in traceback or []:
        found = _CELL_FRAME.match(_ANSI.sub("", str(entry)).strip())
        if found and int(found.group(1)) in counts:
            frames.append((counts[int(found.group(1))], int(found.group(2))))
    return frames


class Adopted:
    """A process that is not our child (a warm kernel or judge zygote, :mod:`.warm_kernel`),
    as much of ``subprocess.Popen`` as jupyter_client's provisioner and the judge pool use;
    its exit status is unknown (1)."""
    stdin = stdout = stderr = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    dead = f.read().rsplit(")", 1)[1].split()[0] in "ZX"
            except OSError:
                dead = True
            self.returncode = 1 if dead else None
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = monotonic() + (timeout if timeout is not None else float("inf"))
        while self.poll() is None:
            if monotonic() > end:
                raise subprocess.TimeoutExpired(f"process {self.pid} (not our child)", timeout)
            sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _kernel_manager(start=None):
    """A kernel manager for the Python running us (not whatever "python3" means).
    ``start(argv, env, cwd)``: the pid of a kernel started elsewhere (a warm one), or None."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class Specs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            if kernel_name == CURRENT_ENV:
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                              **ipykernel.kernelspec.get_kernel_dict())
            return super().get_kernel_spec(kernel_name)

    class Manager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            env = dict(kw.get("env") or os.environ)
            pid = start(list(kernel_cmd), env, str(kw.get("cwd") or os.getcwd())) if start else None
            if pid is None:
                return await super()._async_launch_kernel(kernel_cmd, **kw)
            p = self.provisioner
            p.process, p.pid, p.pgid, p.cwd = Adopted(pid), pid, pid, kw.get("cwd")
            self._reconcile_connection_info(p.connection_info)

    return Manager(kernel_name=CURRENT_ENV, kernel_spec_manager=Specs())


async def _responsive(kc, wait: float = 3.0) -> bool:
    """Does the kernel answer a kernel_info request within ``wait`` seconds?"""
    from nbclient.util import ensure_async
    msg_id = await ensure_async(kc.kernel_info())
    end = monotonic() + wait
    while monotonic() < end:
        try:
            msg = await ensure_async(kc.shell_channel.get_msg(timeout=max(0.1, end - monotonic())))
        except Empty:
            return False
        if msg["parent_header"].get("msg_id") == msg_id:
            return True
    return False


async def _shutdown(client) -> None:
    """Kill the kernel's whole process group (what it forked too) and close channels."""
    km, kc, client.km, client.kc = client.km, client.kc, None, None
    if kc is not None:
        kc.stop_channels()
    if km is not None and km.has_kernel:
        await km.shutdown_kernel(now=True)


async def silent(client, code: str, expressions: Optional[dict] = None,
                 wait: float = 10.0) -> dict:
    """Run ``code`` in the kernel without output or history; the reply's content
    (``{}`` when the kernel does not answer within ``wait`` seconds)."""
    from nbclient.util import ensure_async
    msg_id = await ensure_async(client.kc.execute(code, silent=True, store_history=False,
                                                   user_expressions=expressions or {}))
    end = monotonic() + wait
    while monotonic() < end:
        try:
            msg = await ensure_async(client.kc.shell_channel.get_msg(
                timeout=max(0.1, end - monotonic())))
        except Empty:
            break
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg.get("content", {})
    return {}


OOM_MESSAGE = "the kernel (or a process it started) was killed for memory"


def cell_limit(cell) -> float:
    """A check's own time limit in seconds (``metadata.mgpu_lab.timeout``, the instructor's:
    a design check whose answer must come from reasoning, not from running the lab's
    evaluator over every candidate), or infinity. It only ever lowers ``--timeout``."""
    limit = (cell.metadata.get("mgpu_lab") or {}).get("timeout")
    return float(limit) if isinstance(limit, (int, float)) and limit > 0 else float("inf")


async def _run(nb, cwd, timeout, total_timeout, bar, state, before=None,
               after=None, graded_history=True, start_kernel=None,
               oom_kills=None) -> List[CellResult]:
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from nbclient.util import ensure_async

    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    counts: Dict[int, int] = {}      # this kernel's execution counts -> cell index
    deadline = monotonic() + total_timeout if total_timeout else float("inf")
    replies, results, skip = {}, {}, set()

    def on_executed(cell, cell_index, execute_reply):
        replies[cell_index] = execute_reply

    client = NotebookClient(
        nb, allow_errors=True, interrupt_on_timeout=True, error_on_timeout=TIMEOUT_REPLY,
        timeout_func=lambda cell: max(1.0, min(timeout, cell_limit(cell), deadline - monotonic())),
        record_timing=False, iopub_timeout=4,
        resources={"metadata": {"path": str(cwd)}}, on_cell_executed=on_executed)

    async def execute(i, first=False) -> CellResult:
        cell = nb.cells[i]
        expected = "raises-exception" in cell.metadata.get("tags", [])
        graded = (cell.metadata.get("nbgrader") or {}).get("grade", False)
        start, history = monotonic(), graded_history or not graded
        kills = oom_kills() if oom_kills is not None else None
        try:
            if first and before is not None:
                await before(client, i, cell)
            start = monotonic()
            await client.async_execute_cell(cell, i, store_history=history)
        except DeadKernelError:
            return _killed(CellResult(i, "DeadKernel", "the kernel died running this cell",
                                      monotonic() - start, expected, died=True), kills)
        content = (replies.pop(i, None) or {}).get("content", {})
        result = CellResult(i, seconds=monotonic() - start, expected_error=expected)
        if isinstance(content.get("execution_count"), int):    # without history: the next one's
            counts[content["execution_count"] + (0 if history else 1)] = i
        if content.get("status") == "error":
            result.error, result.message = content.get("ename"), content.get("evalue", "")
            result.frames = cell_frames(content.get("traceback"), counts)
        elif content.get("status") != "ok":
            result.error, result.message = "NoReply", f"status {content.get('status')!r}"
        if first and after is not None:
            try:
                await after(client, i, cell, result)
            except DeadKernelError:
                pass  # the next cell finds the kernel dead and restarts it
        return _killed(result, kills)

    def _killed(result: CellResult, kills) -> CellResult:
        """``result`` as "OutOfMemory" when it failed while the OOM killer killed (a cell
        that raised nothing keeps OOM_MESSAGE as its message: a subprocess was killed)."""
        if result.error != "Timeout" and kills is not None and (oom_kills() or 0) > kills:
            if result.error is not None:
                result.error, result.frames = "OutOfMemory", []
            result.message = OOM_MESSAGE
        return result

    pos, restarts = 0, 0
    while pos < len(code):
        client.km = state["km"] = _kernel_manager(start_kernel)
        counts.clear()
        try:
            await client.async_start_new_kernel(stderr=subprocess.DEVNULL)
            await client.async_start_new_kernel_client()
            if pos == 0:
                msg_id = await ensure_async(client.kc.kernel_info())
                info = await client.async_wait_for_reply(msg_id)
                if info and "language_info" in info["content"]:
                    nb.metadata["language_info"] = info["content"]["language_info"]
            for i in code[:pos]:  # a fresh kernel: rebuild the state once
                replayed = await execute(i) if i not in skip else None
                if replayed is not None and (replayed.died or replayed.error == "Timeout"):
                    for j in code[pos:]:
                        results[j] = CellResult(j, "DeadKernel", "state lost: replay failed")
                    pos = len(code)
                    break
            while pos < len(code):
                i = code[pos]
                pos += 1
                if monotonic() >= deadline:
                    results[i] = CellResult(i, "TotalTimeout", f"past {total_timeout:g} s in all")
                    continue
                results[i] = await execute(i, first=True)
                if bar is not None:
                    bar.update(1)
                if results[i].died or (
                        results[i].error == "Timeout" and not await _responsive(client.kc)):
                    skip.add(i)
                    break
        finally:
            await _shutdown(client)
            state["km"] = None
        restarts += 1
        if pos < len(code) and restarts > MAX_RESTARTS:
            for j in code[pos:]:
                results[j] = CellResult(j, "DeadKernel", f"over {MAX_RESTARTS} kernel restarts")
            break
    client.set_widgets_metadata()
    return [results[i] for i in code]


def run_notebook(nb, cwd=".", timeout: float = 120.0, total_timeout: Optional[float] = None,
                 desc: Optional[str] = None, progress: bool = True, before=None,
                 after=None, graded_history: bool = True, start_kernel=None,
                 oom_kills=None) -> List[CellResult]:
    """Execute ``nb`` in place (outputs stored in it) under the limits above.

    Returns one :class:`CellResult` per non-empty code cell; never raises for
    errors inside the notebook. ``graded_history=False`` keeps graded cells out
    of the kernel's input history (the grader: no ``In[]`` view of hidden tests).
    ``start_kernel(argv, env, cwd)``: a kernel's pid, started warm (:mod:`.warm_kernel`),
    or None to start it here. ``oom_kills()``: the OOM kills of the kernel's cgroup so far
    (None: unknown), read around each cell.
    """
    from nbclient.util import run_sync
    from tqdm.auto import tqdm

    n = sum(1 for c in nb.cells if c.cell_type == "code" and c.source.strip())
    bar = tqdm(total=n, desc=desc, unit="cell", leave=False, file=sys.stderr,
               disable=not progress)
    state = {"km": None}  # the live kernel, so that Ctrl-C cannot orphan it
    try:
        return run_sync(_run)(nb, cwd, timeout, total_timeout, bar, state, before, after,
                              graded_history, start_kernel, oom_kills)
    except BaseException:
        km = state["km"]
        if km is not None and km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
        raise
    finally:
        bar.close()
