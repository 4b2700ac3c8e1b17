"""Bytes on the wire, read from the operating system's own counters of this process's sockets.

A byte count of a collective is *computed* when a formula is applied to the sizes of the
tensors it was given (``CollectiveLog.wire_bytes``: (N-1)/N of the tensor per rank over a
ring, twice that for an all-reduce); it is *measured* when it is read from what the sockets
carried. On Linux each TCP socket keeps ``struct tcp_info`` (``linux/tcp.h``, read with
``getsockopt(IPPROTO_TCP, TCP_INFO)``): ``tcpi_bytes_sent`` less ``tcpi_bytes_retrans``
(Linux 4.19: bytes handed to the network, each once — a busy machine's loopback does
retransmit, tens of KiB in a step here; on an older kernel ``tcpi_bytes_acked``, bytes the
peer acknowledged) and ``tcpi_bytes_received`` (in order, each once). gloo's connections between ranks are ordinary TCP
sockets of the rank's process (over loopback on one machine), so::

    with WireMeter() as wire:              # in each rank
        dist.all_reduce(t)
    wire.sent, wire.received               # payload bytes this rank's TCP sockets carried

A rank can leave a collective while its last message still waits in gloo's queue (it has
received what it needed; its peer has not yet received what it sent), so the meter ends
with a barrier of the group (``sync=True``, the default when a process group is up): every
byte sent before it has then crossed, and the barrier's own few bytes are counted too.

The counts are TCP payload: what gloo wrote, its own message headers included (the
*framing*: a few dozen bytes per message, measured by :func:`framing_per_message`), no
TCP/IP headers. The rendezvous store's connection (``MASTER_PORT``) is left out: it carries
the store's keys, not the collectives. Only TCP is seen: NCCL over NVLink or InfiniBand
moves bytes no socket counts (there the count is ``None``: say "computed" instead).
"""
from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Dict, Optional, Tuple

__all__ = ["WireMeter", "socket_counters", "framing_per_message"]

# struct tcp_info (linux/tcp.h): byte offsets of the u64 counters read here.
BYTES_ACKED, BYTES_RECEIVED, BYTES_SENT, BYTES_RETRANS = 120, 128, 200, 208
TCP_INFO_LEN = 232


def _tcp_info(fd: int) -> Optional[Tuple[int, int, tuple, tuple]]:
    """``(sent, received, local address, peer address)`` of TCP socket ``fd``, or None."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
        if len(info) < BYTES_RECEIVED + 8:
            return None
        if len(info) >= BYTES_RETRANS + 8:
            sent = struct.unpack_from("Q", info, BYTES_SENT)[0] - struct.unpack_from("Q", info, BYTES_RETRANS)[0]
        else:
            sent, = struct.unpack_from("Q", info, BYTES_ACKED)
        received, = struct.unpack_from("Q", info, BYTES_RECEIVED)
        return sent, received, sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:                     # not connected, or not a TCP socket after all
        return None
    finally:
        sock.close()                    # the duplicate only


def socket_counters(exclude_ports=()) -> Optional[Dict[tuple, Tuple[int, int]]]:
    """``{(local, peer): (bytes sent, bytes received)}`` of this process's connected TCP
    sockets, but those with an end on a port of ``exclude_ports``; None off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "TCP_INFO"):
        return None
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
        except OSError:
            continue
        got = _tcp_info(int(name))
        if got is None:
            continue
        sent, received, local, peer = got
        if local[1] in exclude_ports or peer[1] in exclude_ports:
            continue
        out[(local, peer)] = (sent, received)
    return out


def _store_ports() -> tuple:
    port = os.environ.get("MASTER_PORT")
    return (int(port),) if port and port.isdigit() else ()


class WireMeter:
    """The bytes this process's TCP sockets sent and received while the block ran (the
    rendezvous store's connection left out), a barrier of ``group`` at its end (``sync``):
    ``sent``, ``received`` (None where they cannot be read: not Linux). A socket opened during
    the block counts from zero."""

    def __init__(self, exclude_ports=None, sync: bool = True, group=None):
        self.exclude = tuple(exclude_ports) if exclude_ports is not None else _store_ports()
        self.sync, self.group = sync, group
        self.sent: Optional[int] = None
        self.received: Optional[int] = None
        self._before: Optional[dict] = None

    def __enter__(self) -> "WireMeter":
        self._before = socket_counters(self.exclude)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist
        if self.sync and exc[0] is None and dist.is_available() and dist.is_initialized():
            dist.barrier(self.group)         # what this rank sent has crossed
        after = socket_counters(self.exclude)
        if self._before is None or after is None:
            return
        zero = (0, 0)
        self.sent = sum(s - self._before.get(k, zero)[0] for k, (s, _) in after.items())
        self.received = sum(r - self._before.get(k, zero)[1] for k, (_, r) in after.items())


def framing_per_message(group=None, payload: int = 4096, messages: int = 8) -> float:
    """The bytes gloo adds to each point-to-point message, measured: ``messages`` sends of
    ``payload`` bytes from rank 0 to rank 1 (every rank of ``group`` calls it), the wire's
    count minus the payload, per message (0.0 on the other ranks)."""
    import torch
    import torch.distributed as dist
    from ..runtime.distributed import global_rank
    rank = dist.get_rank(group)
    buf = torch.zeros(payload, dtype=torch.uint8)
    dist.barrier(group)
    with WireMeter() as wire:
        for _ in range(messages):
            if rank == 0:
                dist.send(buf, dst=global_rank(group, 1), group=group)
            elif rank == 1:
                dist.recv(buf, src=global_rank(group, 0), group=group)
    dist.barrier(group)
    if rank != 0 or wire.sent is None:
        return 0.0
    return (wire.sent - payload * messages) / messages
