"""``mgpu-lab launch``: torchrun with defaults that fit this machine.

It builds a ``torch.distributed.run`` (torchrun) command line and runs it; it is
not a process manager of its own. One node::

    mgpu-lab launch train.py --epochs 3
    # = torchrun --nnodes 1 --nproc-per-node <GPUs, or 2 on CPU> --rdzv-backend c10d
    #     --rdzv-endpoint 127.0.0.1:<free port> --local-addr 127.0.0.1 train.py --epochs 3

Two nodes (run one command on each machine; node 0 hosts the rendezvous)::

    mgpu-lab launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
    mgpu-lab launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py

With the c10d rendezvous, ``--node-rank`` says which node hosts the rendezvous
store (node 0, at master-addr:master-port); torchrun numbers the nodes as they
join, so GROUP_RANK may differ from ``--node-rank`` on the others. ``--dry-run``
prints the torchrun command instead of running it.
"""
from __future__ import annotations

import argparse
import errno
import os
import shlex
import socket
import sys
from typing import List, Optional

from .devices import gpu_count

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise a clear error if ``port`` is already taken on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise SystemExit(
                    f"mgpu-lab launch: port {port} on {host} is already in use (another job, or a previous "
                    "run still shutting down). Choose another --master-port"
                    + (", or leave it out to get a free one." if host == LOOPBACK else ".")
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                return  # master-addr is another machine's address: nothing to check here
            raise


def default_nproc(args: argparse.Namespace) -> int:
    """``--nproc-per-node`` as given (0 and negatives too: refused by the caller), else the GPU count, or 2."""
    return args.nproc_per_node if args.nproc_per_node is not None else (gpu_count() or 2)


def torchrun_args(args: argparse.Namespace) -> List[str]:
    """The ``torch.distributed.run`` argument list for our options."""
    nproc = default_nproc(args)
    if args.nnodes < 1 or nproc < 1:
        raise SystemExit("mgpu-lab launch: --nnodes and --nproc-per-node must be >= 1")
    if args.nnodes == 1:
        addr = args.master_addr or LOOPBACK
        port = args.master_port or free_port(addr)
        host_conf = []
    else:
        if not args.master_addr or args.node_rank is None:
            raise SystemExit(
                "mgpu-lab launch: with --nnodes > 1, give --node-rank (0 on the node that hosts the "
                "rendezvous) and --master-addr (node 0's address, reachable from every node)."
            )
        if not 0 <= args.node_rank < args.nnodes:
            raise SystemExit(f"mgpu-lab launch: --node-rank {args.node_rank} must be in 0..{args.nnodes - 1}")
        addr, port = args.master_addr, args.master_port or 29500
        host_conf = ["--rdzv-conf", f"is_host={'true' if args.node_rank == 0 else 'false'}"]
    if args.master_port and (args.nnodes == 1 or args.node_rank == 0):
        check_port_free(addr, port)
    local_addr = ["--local-addr", LOOPBACK] if addr in (LOOPBACK, "localhost") else []
    return [
        "--nnodes", str(args.nnodes), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}", "--rdzv-id", args.rdzv_id,
        *host_conf, *local_addr, "--max-restarts", str(args.max_restarts),
        args.script, *args.script_args,
    ]


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription_note(nproc: int) -> Optional[str]:
    """One line when ``nproc`` CPU ranks (no GPU) outnumber the cores: they will time-share."""
    cores = cpu_cores()
    if gpu_count() or nproc <= cores:
        return None
    return (f"mgpu-lab launch: {nproc} ranks on {cores} CPU core(s): the ranks time-share the cores, so the run is "
            f"about {nproc / cores:.1f}x slower per step than on {nproc} cores and its timings are not theirs "
            "(correct, only slow); --nproc-per-node sets the count")


def run(args: argparse.Namespace) -> int:
    argv = torchrun_args(args)
    if args.dry_run:                # the command only: it may be for another machine's cores
        print(shlex.join(["torchrun", *argv]))
        return 0
    note = oversubscription_note(default_nproc(args))
    if note:
        print(note, file=sys.stderr)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # A rank that dies by a signal (SIGSEGV, SIGABRT from std::terminate) prints its Python stack.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")

    try:
        torchrun_main(argv)
    except ChildFailedError as exc:  # torchrun's summary: which rank failed first, its exit code and error
        print(exc.format_msg(), file=sys.stderr)
        print(f"mgpu-lab launch: {exc.name} failed; the summary above names the first rank that failed.",
              file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run a training script on every device (torchrun underneath)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                   help="processes on this node (default: the GPU count, or 2 on CPU)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (machines)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's index; 0 hosts the rendezvous")
    p.add_argument("--master-addr", "--master_addr", default=None, help="node 0's address (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rendezvous port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the whole group this many times when a rank fails (elastic)")
    p.add_argument("--rdzv-id", default="mgpu-lab", help="job id; the same on every node")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)
