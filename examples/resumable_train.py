"""DDP training that survives a rank's death: checkpoint, restart, resume bit for bit.

    mgpu-lab launch --nproc-per-node 2 --max-restarts 2 examples/resumable_train.py --ckpt /tmp/run/state.pt --die 7:exit,15:kill

torchrun (under ``mgpu-lab launch``) watches its workers; when one dies it stops
the others and starts the whole group again, up to ``--max-restarts`` times
(``TORCHELASTIC_RESTART_COUNT`` tells a worker which attempt it is). Nothing of
the dead attempt survives except files, so the script checkpoints every
``--every`` steps with ``TrainState`` (model, optimizer, loss scaler, step,
sampler epoch and every rank's RNG) and, on start, resumes from the checkpoint
if there is one. ``--die 7:exit,15:kill`` makes rank 1 die once at step 7
(``os._exit``, as after an uncaught C++ error) and once at step 15 (SIGKILL, as
from the OOM killer); marker files next to the checkpoint make each death happen
only once. The final weights equal an uninterrupted run's, bit for bit.

Resuming mid-epoch or at an epoch boundary: ``TrainState(..., dataloader=loader)`` saves the
loader's position in its epoch and every rank's random-number states as the epoch's iterator was
made and at the save; the first ``iter(loader)`` after ``load`` replays the iterator's draws, skips
the batches already seen (advancing the sampler only: nothing is read again) and restores the
saved states, so dropout and the shuffle continue as if nothing happened.
"""
import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from mgpu_lab import TrainState, cleanup, distributed_loader, init_distributed, rank_device, save_checkpoint
from mgpu_lab.parallel.wrappers import unwrap


def make_dataset(n=96, features=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, x.sin().sum(1, keepdim=True))


def parse(argv=None):
    p = argparse.ArgumentParser(description="resumable DDP training (see the module docstring)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4, help="checkpoint every this many steps")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--ckpt", required=True, help="the checkpoint file (resumed from when it exists)")
    p.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    p.add_argument("--die", default="", help="STEP:exit|kill,...: rank 1 dies once at each STEP")
    return p.parse_args(argv)


def maybe_die(step, rank, spec, folder):
    for item in filter(None, spec.split(",")):
        at, how = item.split(":")
        marker = Path(folder) / f"died_at_{at}"
        if rank == 1 and step == int(at) and not marker.exists():
            marker.touch()  # so that the restarted rank 1 does not die here again
            print(f"rank 1: dying at step {step} ({how})", flush=True)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)


def train(args):
    """The training loop; the process group must exist. Returns rank 0's final state (else None)."""
    rank, device = torch.distributed.get_rank(), rank_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 8, growth_interval=3)
    loader = distributed_loader(make_dataset(), batch_size=args.batch_size, drop_last=True, seed=0)
    torch.manual_seed(1000 + rank)  # every rank its own dropout stream: all of them must be restored

    state = TrainState(model, optimizer, scaler, dataloader=loader.loader, path=args.ckpt, keep=2)
    start = state.step if state.load(map_location=device) else 0
    for epoch in range(state.epoch, -(-args.steps // len(loader))):   # state.epoch: the epoch to run
        for x, y in loader.epoch(epoch):       # set_epoch, then iter(): after load, the rest of the epoch
            maybe_die(state.step, rank, args.die, os.path.dirname(os.path.abspath(args.ckpt)))
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            state.step += 1
            if state.step % args.every == 0:
                state.save()  # every rank: it gathers the RNG states; rank 0 writes
            if state.step == args.steps:
                break
    final = {"model": unwrap(model).state_dict(), "rng": torch.rand(4)}
    if args.out:
        save_checkpoint(args.out, **final)
    if rank == 0:
        print(json.dumps({"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "resumed_from": start,
                          "steps": state.step, "loss": round(loss.item(), 2)}), flush=True)
        return final
    return None


def main(argv=None):
    args = parse(argv)
    init_distributed()
    try:
        train(args)
    except BaseException:
        cleanup()
        raise
    cleanup(exit=True)  # see mgpu_lab.cleanup


if __name__ == "__main__":
    main()
