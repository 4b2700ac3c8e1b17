"""lab03_single.py converted to DDP.   torchrun --standalone --nproc-per-node=2 lab03_ddp.py --epochs 2"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from lab03_setup import cleanup, setup
from lab03_single import SEED, make_data, make_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch: split over the ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint", default="ddp_ckpt.pt")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", default="ddp_final.pt")
    args = parser.parse_args()
    ### BEGIN SOLUTION
    rank, local_rank, world_size, device = setup()
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} (global) must be a multiple of the {world_size} ranks")
    per_rank_batch = args.batch_size // world_size
    train_set, val_set = make_data(64, seed=0), make_data(25, seed=1)
    model = make_model().to(device)  # same seed on every rank (and DDP broadcasts rank 0's weights anyway)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if args.resume:  # every rank loads, onto ITS device, into the unwrapped model
        ckpt = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])  # momentum buffers: resume, do not restart
        start = ckpt["epoch"] + 1
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank) if device.type == "cuda" else DDP(model)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)  # permutation seeded by SEED + epoch, the same on every rank
        ddp.train()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()  # gradients averaged over the ranks here
            optimizer.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       args.checkpoint)  # model = ddp.module: no "module." prefix
        dist.barrier()  # nobody reads the checkpoint before it is complete
    if rank == 0:
        torch.save(ddp.module.state_dict(), args.out)
    dist.barrier()

    # Evaluation: every rank loads the saved weights into a fresh, unwrapped model on its own device ...
    best = make_model().to(device)
    best.load_state_dict(torch.load(args.out, map_location=device))
    best.eval()
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    real = torch.arange(len(val_sampler)) * world_size + rank < len(val_set)  # False for the padding repeats
    errors = []
    with torch.no_grad():
        for x, y in DataLoader(val_set, batch_size=8, sampler=val_sampler):
            errors.append(F.mse_loss(best(x.to(device)), y.to(device), reduction="none").sum(dim=1))
    errors = torch.cat(errors)[real.to(device)]
    # ... and the metric is all-reduced: a sum and a count, divided once at the end
    totals = torch.tensor([errors.sum().item(), float(len(errors))], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    if rank == 0:
        print(json.dumps({"world_size": world_size, "per_rank_batch": per_rank_batch, "global_batch": args.batch_size,
                          "steps_per_epoch": len(loader), "val_mse": round(totals[0].item() / totals[1].item(), 6),
                          "val_count": int(totals[1].item())}))
    del ddp  # drop the wrapper before the group it uses (torch 2.13, gloo: otherwise rank exits sometimes abort)
    cleanup()
    ### END SOLUTION


if __name__ == "__main__":
    main()
