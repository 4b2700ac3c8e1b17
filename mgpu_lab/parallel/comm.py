"""torch's one-tensor all-gather and reduce-scatter, under the name this torch gives them.

torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and
``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old names warn); older
versions have only the old names. Every module of the library calls these two
functions instead, and they look the name up in ``torch.distributed`` at each call,
never at import: a tool that replaces ``torch.distributed``'s functions while it is
active (``mgpu_lab.measure.collective_trace``) then sees every all-gather and
reduce-scatter the library issues (``collective_trace`` skips this file when it names
the call site, so the caller is named).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's ``input`` along dimension 0 into ``output`` (N times its rows)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``input`` over the ranks and keep this rank's ``1/N`` of its rows in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)
