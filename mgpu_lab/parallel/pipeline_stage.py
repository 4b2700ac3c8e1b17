"""One pipeline stage: a rank's part of the model, and the messages to its neighbours.

``forward_one_chunk(k)`` receives micro-batch k's activations from the previous
stage (the first stage is given its input), runs the module, keeps the input
and output for the backward, and sends the output to the next stage.
``backward_one_chunk(k)`` receives the gradient of that output from the next
stage (the last stage starts from the loss), runs backward, and sends the
input's gradient to the previous stage. Which action comes when is the
schedule's business (``pipeline.py``), not the stage's.

Messages: an activation travels as a small header (its micro-batch, shape and
dtype) and then the tensor; a gradient has the shape of the activation the stage
sent, so it needs no header. (torch's stage instead learns the shapes once, at
the first step, and saves the header's latency; ours may change shape from one
micro-batch to the next, and checks that neighbours agree on the order.)

Sends are asynchronous. A stage posts the sends of one action together with the
receive of its next action (``batch_isend_irecv``, as torch's 1F1B fuses them),
so two neighbours that each send and then receive never wait on each other
(NCCL orders a pair's sends and receives). Receives are posted only when needed,
never ahead: on NCCL a receive waiting in the pair's queue would hold up the
sends behind it. ``finish()`` waits
until every send arrived. Every wait has a timeout, and a stage that waited too
long says for which stage and which micro-batch.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.distributed import rank_device

Action = Tuple[str, int]  # ("F" | "B", micro-batch)
MAX_DIMS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)


class PipelineStage:
    """``module``, the part of the model on this rank, as stage ``stage_index`` of ``num_stages``.

    Stage i runs on rank i of ``group`` (default: the world). ``timeline`` lists the
    actions run since the last ``reset()``, ``spans`` their (start, end) ``perf_counter``
    times (compute only, not the waits). ``timeout``: seconds any wait may take.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, group=None,
                 device: Optional[torch.device] = None, timeout: float = 300.0):
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage: torch.distributed is not initialised; build the stage inside "
                               "mgpu_lab.launch(...) or after mgpu_lab.init_distributed()")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if num_stages != size or stage_index != rank:
            raise ValueError(f"PipelineStage: stage i runs on rank i of a group of num_stages ranks; this is rank "
                             f"{rank} of {size}, given stage_index={stage_index}, num_stages={num_stages}")
        self.module, self.stage_index, self.num_stages, self.group = module, stage_index, num_stages, group
        self.device = torch.device(device) if device is not None else rank_device()
        self.timeout = timeout
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._pending: List[Tuple[dist.P2POp, str, int]] = []  # sends not posted yet: (op, what, peer stage)
        self._sent: List[Tuple[dist.Work, str, int]] = []  # posted sends, waited for in finish()
        self.reset()

    def reset(self) -> None:
        """Start a step: forget the timeline and any activations still held."""
        self.timeline: List[Action] = []
        self.spans: List[Tuple[float, float]] = []
        self._held: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def _peer(self, stage: int) -> str:
        rank = stage if self.group is None else dist.get_global_rank(self.group, stage)
        return f"stage {stage} (rank {rank})"

    # the messages
    def _send(self, tensor: torch.Tensor, to: int, what: str) -> None:
        self._pending.append((dist.P2POp(dist.isend, tensor, group=self.group, group_peer=to), what, to))

    def _receive(self, tensor: torch.Tensor, frm: int, what: str) -> torch.Tensor:
        """Post the pending sends and this receive together; wait for the receive."""
        works = self._post([(dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=frm), what, frm)])
        self._wait(works[-1], f"waited for {self._peer(frm)} to send {what}", frm)
        return tensor

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
            if "timed out" in str(e).lower():
                raise TimeoutError(f"pipeline stage {self.stage_index} {what}, for {self.timeout:g} s; is "
                                   f"{self._peer(peer)} running its step with the same schedule?") from e
            raise RuntimeError(f"pipeline stage {self.stage_index} {what}, but the connection failed "
                               f"({self._peer(peer)} may have crashed): {e}") from e

    def _receive_activation(self, k: int) -> torch.Tensor:
        header = self._receive(torch.empty(MAX_DIMS + 3, dtype=torch.int64, device=self.device), self.stage_index - 1,
                               f"the activations' shape of micro-batch {k}").tolist()
        sent_k, ndim, dtype = header[0], header[1], DTYPES[header[-1]]
        if sent_k != k:
            raise RuntimeError(f"pipeline stage {self.stage_index} runs the forward of micro-batch {k}, but "
                               f"{self._peer(self.stage_index - 1)} sent micro-batch {sent_k}: the stages' "
                               f"orders must run the forwards in the same order")
        x = torch.empty(header[2:2 + ndim], dtype=dtype, device=self.device)
        return self._receive(x, self.stage_index - 1, f"the activations of micro-batch {k}")

    def _send_activation(self, y: torch.Tensor, k: int) -> None:
        if y.dim() > MAX_DIMS or y.dtype not in DTYPES:
            raise ValueError(f"stage {self.stage_index}: cannot send a {y.dim()}-d {y.dtype} output "
                             f"(at most {MAX_DIMS} dimensions, dtype in {DTYPES})")
        shape = list(y.shape) + [0] * (MAX_DIMS - y.dim())
        header = torch.tensor([k, y.dim()] + shape + [DTYPES.index(y.dtype)], dtype=torch.int64, device=self.device)
        what = f"the activations of micro-batch {k}"
        self._send(header, self.stage_index + 1, what)
        self._send(y.detach().contiguous(), self.stage_index + 1, what)

    # the two actions
    def forward_one_chunk(self, k: int, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward of micro-batch ``k``: the first stage is given ``x``, the others receive it."""
        if self.is_first:
            if not torch.is_tensor(x):
                raise ValueError(f"the first stage's forward of micro-batch {k} needs its input tensor")
            self._post()
        else:
            x = self._receive_activation(k)
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
            self._send_activation(y, k)
        return y

    def backward_one_chunk(self, k: int, loss: Optional[torch.Tensor] = None) -> None:
        """Backward of micro-batch ``k``: the last stage from ``loss``, the others from the
        output's gradient they receive. Sends the input's gradient to the previous stage."""
        if k not in self._held:
            raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {k} without its forward "
                               f"(or a second time)")
        x, y = self._held.pop(k)
        if self.is_last:
            if loss is None:
                raise ValueError("the last stage's backward needs the micro-batch's loss")
            self._post()
            outputs, grads = loss, None
        elif y.is_floating_point():
            grad = torch.empty_like(y, memory_format=torch.contiguous_format)
            outputs, grads = y, self._receive(grad, self.stage_index + 1, f"the gradient of micro-batch {k}")
        else:
            self._post()
            outputs, grads = None, None
        start = time.perf_counter()
        if outputs is not None and outputs.requires_grad:
            torch.autograd.backward(outputs, grads)
        self.spans.append((start, time.perf_counter()))
        self.timeline.append(("B", k))
        if not self.is_first and x.is_floating_point():
            self._send(x.grad if x.grad is not None else torch.zeros_like(x), self.stage_index - 1,
                       f"the gradient of micro-batch {k}")

    def finish(self) -> None:
        """End of a step: post the last sends and wait until the neighbours received them all."""
        self._post()
        sent, self._sent = self._sent, []
        for work, what, to in sent:
            self._wait(work, f"waited for {self._peer(to)} to receive {what}", to)
