"""``mgpu-lab doctor``: what this machine can do for distributed training, and what is off.

It prints the versions (torch, CUDA, NCCL, gloo), the GPUs with their memory,
the backend ``init_distributed()`` would choose, the distributed environment
variables that are set, and advice for combinations known to go wrong. The
advice is also a function, ``advice(environ)``, so it can be tested and reused.
"""
from __future__ import annotations

import os
import platform
import socket
from typing import List, Mapping

import torch
import torch.distributed as dist

from .devices import backend, gpu_count

ENV_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE",
    "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS",
)


def _interfaces() -> List[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _ifname_matches(spec: str, interfaces: List[str]) -> bool:
    """NCCL_SOCKET_IFNAME syntax: 'eth' is a prefix, '=eth0' exact, '^docker' excludes."""
    if spec.startswith("^"):
        return True  # an exclusion list leaves the others usable
    names = spec.split(",")
    if spec.startswith("="):
        return any(name.lstrip("=") in interfaces for name in names)
    return any(iface.startswith(name) for name in names for iface in interfaces)


def advice(environ: Mapping[str, str], gpus: int, interfaces: List[str]) -> List[str]:
    """Warnings for settings that are known to break or slow distributed training."""
    tips = []
    has = lambda name: environ.get(name, "") != ""  # noqa: E731
    if "CUDA_VISIBLE_DEVICES" in environ and environ["CUDA_VISIBLE_DEVICES"].strip() in ("", "-1"):
        tips.append("CUDA_VISIBLE_DEVICES is empty or -1: every GPU is hidden, so training runs on CPU (gloo).")
    if has("RANK") != has("WORLD_SIZE"):
        tips.append("Only one of RANK and WORLD_SIZE is set: a launcher sets both. Unset it, or launch with "
                    "`mgpu-lab launch` / torchrun.")
    if has("MASTER_ADDR") != has("MASTER_PORT"):
        tips.append("MASTER_ADDR and MASTER_PORT go together: set both (or neither and let the launcher do it).")
    if gpus == 0 and any(has(n) for n in ("NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE")):
        tips.append("NCCL_* variables are set but there is no GPU: they have no effect on the gloo backend.")
    if environ.get("NCCL_IB_DISABLE") == "1":
        tips.append("NCCL_IB_DISABLE=1: InfiniBand is off, so traffic between nodes goes over TCP sockets "
                    "(much slower). Right for machines without IB or to rule IB out while debugging.")
    if environ.get("NCCL_P2P_DISABLE") == "1":
        tips.append("NCCL_P2P_DISABLE=1: GPUs on one node copy through host memory instead of NVLink/PCIe P2P "
                    "(slower). A workaround for broken P2P, not a setting to keep.")
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if has(name) and interfaces and not _ifname_matches(environ[name], interfaces):
            tips.append(f"{name}={environ[name]} matches no network interface here ({', '.join(interfaces)}): "
                        "connections will fail. Pick one from `ip addr` (the one with the other nodes' subnet).")
    if gpus > 0 and not has("NCCL_DEBUG"):
        tips.append("Debugging a hang or a NCCL error? Run with NCCL_DEBUG=INFO to see which transport and "
                    "interface NCCL picked.")
    return tips


def report() -> str:
    lines = [
        f"python        {platform.python_version()} ({platform.system()} {platform.machine()})",
        f"torch         {torch.__version__}",
        f"CUDA build    {torch.version.cuda or 'none (CPU-only build)'}",
        f"CPU cores     {os.cpu_count()}",
    ]
    gpus = gpu_count()
    if gpus:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "not built"
        lines.append(f"NCCL          {nccl}")
        for i in range(gpus):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}         {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("GPUs          none: the labs use CPU virtual devices (processes over gloo)")
    lines.append(f"gloo          {'available' if dist.is_gloo_available() else 'missing'}")
    if gpus:
        lines.append(f"backend       {backend(gpus)} for up to {gpus} process(es) per node, one GPU each; "
                     f"{backend(gpus + 1)} beyond (what launch() and init_distributed() choose)")
    else:
        lines.append(f"backend       {backend()}  (what launch() and init_distributed() choose)")
    lines.append("device        inside a process, mgpu_lab.rank_device(): cuda:LOCAL_RANK under nccl, else cpu")
    lines.append("environment")
    for name in ENV_VARS:
        lines.append(f"  {name:<22}{os.environ.get(name, '(unset)')}")
    tips = advice(os.environ, gpus, _interfaces())
    lines.append("advice" if tips else "advice        none: nothing known-bad is set")
    lines.extend(f"  - {tip}" for tip in tips)
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="versions, GPUs, backend, distributed variables, advice")
    p.set_defaults(func=lambda args: print(report()) or 0)
