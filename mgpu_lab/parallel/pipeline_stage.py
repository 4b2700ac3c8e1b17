"""One pipeline stage: a part of the model, and the messages to the stages beside it.

``PipelineStage(module, stage_index, num_stages, device, group=...)`` takes torch's
arguments in torch's order. Stage s runs on rank ``s % N`` of the group (N ranks): one
stage per rank when ``num_stages == N``, several (stages r, r + N, ...) for an
interleaved schedule.

``forward_one_chunk(k)`` receives micro-batch k's activations from the previous
stage (the first stage is given its input), runs the module, keeps the input and
output for the backward, and sends the output to the next stage.
``backward_one_chunk(k)`` receives the gradient of that output from the next stage
(the last stage starts from the loss), runs backward, and sends the input's gradient
to the previous stage. Which action comes when is the schedule's business
(``pipeline.py``), not the stage's.

Messages (``_Link``, one per rank, shared by the rank's stages): every tensor travels
as a small header (activation or gradient, for which stage and micro-batch, shape,
dtype) followed by the tensor. Between two ranks messages arrive in the order they
were sent, so a rank waiting for one message takes the ones before it off the line
and keeps them until their action comes (the stages' orders may differ, as they do
under interleaving). torch's stage instead learns the shapes once, at the first step,
and its schedules post each receive exactly when the sender sends.

Sends are asynchronous. A rank posts its pending sends together with the receive it
waits for (``batch_isend_irecv``, as torch's 1F1B fuses them), so two neighbours that
each send and then receive never wait on each other. Receives are posted only when
needed, never ahead: on NCCL a receive waiting in the pair's queue would hold up the
sends behind it. ``finish()`` waits until every send arrived. Every wait has a
timeout, and a stage that waited too long says for which stage and micro-batch.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.distributed import global_rank, rank_device, require_process_group

MAX_DIMS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
KINDS = ("the activations", "the gradient")   # message kinds 0 and 1
Key = Tuple[int, int, int]                    # (kind, receiving stage, micro-batch)


class _Link:
    """This rank's messages to and from the other ranks of ``group``, in send order per pair."""

    def __init__(self, group, device: torch.device, timeout: float):
        self.group, self.device, self.timeout = group, device, timeout
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._pending: List[Tuple[dist.P2POp, str, int]] = []   # sends not posted yet: (op, what, peer rank)
        self._sent: List[Tuple[dist.Work, str, int]] = []       # posted sends, waited for in finish()
        self._arrived: Dict[Key, torch.Tensor] = {}            # received before their action came

    def peer(self, stage: int) -> str:
        rank = stage % self.size
        return f"stage {stage} (rank {global_rank(self.group, rank)})"

    def send(self, tensor: torch.Tensor, kind: int, to_stage: int, k: int) -> None:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
            raise ValueError(f"cannot send a {tensor.dim()}-d {tensor.dtype} tensor between stages "
                             f"(at most {MAX_DIMS} dimensions, dtype in {DTYPES})")
        tensor = tensor.detach().contiguous()
        to = to_stage % self.size
        if to == self.rank:                         # the next stage is on this rank: no message
            self._arrived[(kind, to_stage, k)] = tensor.clone()
            return
        header = [kind, to_stage, k, tensor.dim()] + list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
        header = torch.tensor(header + [DTYPES.index(tensor.dtype)], dtype=torch.int64, device=self.device)
        what = f"{KINDS[kind]} of micro-batch {k}"
        for t in (header, tensor):
            self._pending.append((dist.P2POp(dist.isend, t, global_rank(self.group, to), group=self.group), what, to))

    def receive(self, kind: int, stage: int, k: int, from_stage: int) -> torch.Tensor:
        """The tensor of ``kind`` for ``stage``'s micro-batch ``k``, sent by ``from_stage``."""
        key, frm = (kind, stage, k), from_stage % self.size
        what = f"{KINDS[kind]} of micro-batch {k}"
        if key in self._arrived:
            self.post()
        while key not in self._arrived:
            if frm == self.rank:
                raise RuntimeError(f"pipeline stage {stage} runs before {self.peer(from_stage)} sent it {what}: "
                                   f"on one rank the schedule's order must run stage {from_stage}'s action first")
            header = self._receive(torch.empty(MAX_DIMS + 5, dtype=torch.int64, device=self.device), frm,
                                   stage, what, from_stage).tolist()
            got, ndim = tuple(header[:3]), header[3]
            tensor = torch.empty(header[4:4 + ndim], dtype=DTYPES[header[-1]], device=self.device)
            self._arrived[got] = self._receive(tensor, frm, stage, what, from_stage)
        return self._arrived.pop(key)

    def _receive(self, tensor, frm: int, stage: int, what: str, from_stage: int) -> torch.Tensor:
        """Post the pending sends and this receive together; wait for the receive."""
        op = dist.P2POp(dist.irecv, tensor, global_rank(self.group, frm), group=self.group)
        works = self._post([(op, what, frm)])
        self._wait(works[-1], f"pipeline stage {stage} waited for {self.peer(from_stage)} to send {what}", frm)
        return tensor

    def post(self) -> None:
        """Post the pending sends (an action that receives nothing first)."""
        self._post()

    def _post(self, receives=()) -> List[dist.Work]:
        ops = self._pending + list(receives)
        self._pending = []
        if not ops:
            return []
        works = dist.batch_isend_irecv([op for op, _, _ in ops])
        if len(works) != len(ops):  # NCCL coalesces the batch into one work
            works = [works[-1]] * len(ops)
        self._sent += [(w, what, peer) for w, (op, what, peer) in zip(works, ops) if op.op is dist.isend]
        return works

    def _wait(self, work, what: str, peer: int) -> None:
        try:
            if work.wait(timeout=timedelta(seconds=self.timeout)) is False:
                raise RuntimeError("timed out")
        except RuntimeError as e:
            waiting = [f"{KINDS[kind]} of micro-batch {k} for stage {s}" for kind, s, k in self._arrived]
            unused = f" (arrived, still unused: {', '.join(waiting)})" if waiting else ""
            if "timed out" in str(e).lower():
                raise TimeoutError(f"{what}, for {self.timeout:g} s{unused}; is that rank running its step "
                                   f"with the same schedule?") from e
            raise RuntimeError(f"{what}, but the connection failed (that rank may have crashed): {e}") from e

    def finish(self) -> None:
        """End of a step: post the last sends and wait until the other ranks received them all."""
        self._post()
        sent, self._sent = self._sent, []
        for work, what, to in sent:
            self._wait(work, f"pipeline rank {self.rank} waited for rank {to} to receive {what}", to)
        if self._arrived:
            left = sorted(self._arrived)
            self._arrived = {}
            raise RuntimeError(f"pipeline step ended with messages no action used: {left} "
                               f"(kind 0 activations, 1 gradients; stage, micro-batch)")


class PipelineStage:
    """``module`` as stage ``stage_index`` of ``num_stages``, run on rank ``stage_index % N``
    of ``group`` (default: the world; N its size), on ``device`` (default: ``rank_device()``).

    ``timeline`` lists the actions run since the last ``reset()``, ``spans`` their
    (start, end) ``perf_counter`` times (compute only, not the waits). ``timeout``:
    seconds any wait may take.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, device=None, *,
                 group=None, timeout: float = 300.0):
        require_process_group("PipelineStage")
        if isinstance(device, dist.ProcessGroup):
            raise TypeError("PipelineStage(module, stage_index, num_stages, device, group=...): the fourth "
                            "argument is the device (torch's order); pass the process group as group=")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if not (isinstance(num_stages, int) and num_stages >= 1 and isinstance(stage_index, int)
                and 0 <= stage_index < num_stages):
            raise ValueError(f"PipelineStage: expected 0 <= stage_index < num_stages, got stage_index="
                             f"{stage_index!r}, num_stages={num_stages!r}")
        if stage_index % size != rank or num_stages < size:
            raise ValueError(f"PipelineStage: stage s runs on rank s % N of a group of N ranks, with at least N "
                             f"stages; this is rank {rank} of {size}, given stage_index={stage_index}, "
                             f"num_stages={num_stages}")
        self.module, self.stage_index, self.num_stages, self.group = module, stage_index, num_stages, group
        self.device = torch.device(device) if device is not None else rank_device()
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.link = _Link(group, self.device, timeout)  # a schedule of several stages gives them one link
        self.reset()

    @property
    def timeout(self) -> float:
        return self.link.timeout

    def reset(self) -> None:
        """Start a step: forget the timeline and any activations still held."""
        self.timeline: List[Tuple[str, int]] = []
        self.spans: List[Tuple[float, float]] = []
        self._held: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def forward_one_chunk(self, k: int, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward of micro-batch ``k``: the first stage is given ``x``, the others receive it
        (and ignore ``x``, as torch's stage ignores a non-first stage's arguments)."""
        if self.is_first:
            if not torch.is_tensor(x):
                raise ValueError(f"the first stage's forward of micro-batch {k} needs its input tensor")
            self.link.post()
        else:
            x = self.link.receive(0, self.stage_index, k, self.stage_index - 1)
            x.requires_grad_(x.is_floating_point() and torch.is_grad_enabled())
        start = time.perf_counter()
        y = self.module(x)
        self.spans.append((start, time.perf_counter()))
        self.timeline.append(("F", k))
        if not torch.is_tensor(y):
            raise TypeError(f"stage {self.stage_index}'s module must return one tensor, got {type(y).__name__}")
        if torch.is_grad_enabled():
            self._held[k] = (x, y)
        if not self.is_last:
            self.link.send(y, 0, self.stage_index + 1, k)
        return y

    def backward_one_chunk(self, k: int, loss: Optional[torch.Tensor] = None) -> None:
        """Backward of micro-batch ``k``: the last stage from ``loss``, the others from the
        output's gradient they receive. Sends the input's gradient to the previous stage."""
        if k not in self._held:
            raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {k} without its forward "
                               f"(or a second time)")
        x, y = self._held.pop(k)
        outputs, grads = None, None
        if self.is_last:
            if loss is None:
                raise ValueError("the last stage's backward needs the micro-batch's loss")
            outputs = loss
        elif y.is_floating_point():
            outputs, grads = y, self.link.receive(1, self.stage_index, k, self.stage_index + 1)
        if grads is None:
            self.link.post()
        start = time.perf_counter()
        if outputs is not None and outputs.requires_grad:
            torch.autograd.backward(outputs, grads)
        self.spans.append((start, time.perf_counter()))
        self.timeline.append(("B", k))
        if not self.is_first and x.is_floating_point():
            self.link.send(x.grad if x.grad is not None else torch.zeros_like(x), 1, self.stage_index - 1, k)

    def finish(self) -> None:
        """End of a step: post the last sends and wait until the other ranks received them all."""
        self.link.finish()
