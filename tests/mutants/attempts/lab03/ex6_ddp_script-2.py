# origin: considered alternative
# what I believed: section 3 says "use drop_last=True when you can afford to lose the tail": a validation
#   DistributedSampler with drop_last=True avoids the padding duplicate, so the all-reduced MSE is the right one.
# visible check said: AssertionError: val_count 24: count each validation sample once (padding!)
# grader said: 0/4 AssertionError: val_count 24: count each validation sample once (padding!) (check line 49) The check compared `ddp_source`, `exit_code`, `stderr`, `stdout`, `weights` with the solution's, case by case: `ddp_source` is the first to differ: another string, bool or None.
# misconception: drop_last=True does not count each sample once, it drops the tail (25 -> 24 samples on 2 ranks); the exercise wants all 25 exactly once, so only the padding repeats may be dropped.
%%writefile lab03_ddp.py
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
    rank, local_rank, world_size, device = setup()
    per_rank_batch = args.batch_size // world_size

    train_set, val_set = make_data(64, seed=0), make_data(25, seed=1)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if args.resume:
        ckpt = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = ckpt["epoch"] + 1
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank) if device.type == "cuda" else DDP(model)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       args.checkpoint)
        dist.barrier()
    if rank == 0:
        torch.save(ddp.module.state_dict(), args.out)
    dist.barrier()

    ddp.eval()
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    squared_error, count = 0.0, 0
    with torch.no_grad():
        for x, y in DataLoader(val_set, batch_size=8, sampler=val_sampler):
            squared_error += F.mse_loss(ddp(x.to(device)), y.to(device), reduction="sum").item()
            count += len(x)
    totals = torch.tensor([squared_error, float(count)], device=device)
    dist.all_reduce(totals)
    if rank == 0:
        print(json.dumps({"world_size": world_size, "per_rank_batch": per_rank_batch, "global_batch": args.batch_size,
                          "steps_per_epoch": len(loader), "val_mse": round(totals[0].item() / totals[1].item(), 6),
                          "val_count": int(totals[1].item())}))
    del ddp
    cleanup()


if __name__ == "__main__":
    main()
