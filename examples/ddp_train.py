"""A small DistributedDataParallel training run: the shape of every DDP script.

    mgpu-lab launch examples/ddp_train.py --steps 50
    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 50   # the same, by hand

One process per device. Each rank builds the same model (same seed), wraps it in
DDP (which broadcasts rank 0's weights and all-reduces gradients in backward),
reads its own shard of the data through a DistributedSampler, and rank 0 alone
logs and saves. It prints one JSON line at the end (rank 0) so tools can read it.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from mgpu_lab import cleanup, distributed_loader, init_distributed, is_main_process, print0, rank_device


def make_dataset(n=4096, features=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--save", default=None, help="rank 0 saves the model here at the end")
    args = parser.parse_args()

    env = init_distributed()
    device = rank_device()  # cuda:LOCAL_RANK under nccl, else the CPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    model = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = distributed_loader(make_dataset(), batch_size=args.batch_size, drop_last=True)

    step, epoch, step_times = 0, 0, []
    while step < args.steps:
        for x, y in loader.epoch(epoch):
            start = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
            step += 1
            if step % 10 == 0:
                print0(f"step {step:4d}  loss {loss.item():.4f}")
            if step == args.steps:
                break
        epoch += 1

    if args.save and is_main_process():
        torch.save(model.module.state_dict(), args.save)  # .module: the model without the DDP wrapper
    warm = sorted(step_times[5:] or step_times)
    print0(json.dumps({"world_size": env.world_size, "steps": step, "final_loss": round(loss.item(), 4),
                       "median_step_s": warm[len(warm) // 2], "node_rank": env.node_rank}))
    # Every rank done with its collectives and its I/O (rank 0 prints and saves) before any
    # rank closes its connections; then leave (exit=True: see mgpu_lab.cleanup).
    dist.barrier()
    cleanup(exit=True)


if __name__ == "__main__":
    main()
