"""Mutants of lab 03: shard indices, DDP training, rank-0 saving, SyncBatchNorm's statistics,
setup()/cleanup() and the DDP script under torchrun."""
from . import body, mutant, prepend, swap

LAB = "03_ddp_and_launching"


# --- ex1_shard_indices ------------------------------------------------------------------------

@mutant("ex1_shard_indices", "wrong")
def contiguous_blocks(solution):
    "each rank a contiguous block of the padded indices, not every world_size-th one"
    return body(solution, """
        per_rank = -(-n // world_size)
        indices = list(range(n)) * world_size
        return indices[rank * per_rank:(rank + 1) * per_rank] if not drop_last else \\
            list(range(n))[rank * (n // world_size):(rank + 1) * (n // world_size)]
    """)


@mutant("ex1_shard_indices", "reference")
def the_old_reference_helper(solution):
    "the graded cell's old helper `reference`, which wraps DistributedSampler, defined and called"
    return prepend(body(solution, "return reference(n, rank, world_size, drop_last)"), """
        def reference(n, rank, world_size, drop_last=False):
            return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))
    """)


@mutant("ex1_shard_indices", "copy")
def copies_the_checks_sampler_line(solution):
    "the visible judge's own line: a DistributedSampler, listed"
    return body(solution, """
        return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))
    """)


@mutant("ex1_shard_indices", "tamper")
def patches_the_sampler(solution):
    "DistributedSampler made to agree with a wrong answer (contiguous blocks)"
    return prepend(body(solution, """
        per_rank = -(-n // world_size)
        return (list(range(n)) * world_size)[rank * per_rank:(rank + 1) * per_rank]
    """), """
        DistributedSampler.__iter__ = lambda self: iter(shard_indices(len(self.dataset), self.rank, self.num_replicas))
    """)


# --- ex2_train_ddp ----------------------------------------------------------------------------

@mutant("ex2_train_ddp", "wrong")
def no_ddp_wrapper(solution):
    "the model is never wrapped in DDP: each rank trains on its half alone"
    solution = swap(solution, 'DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)',
                    "make_model().to(device)")
    return swap(solution, "model.module.state_dict()", "model.state_dict()")


@mutant("ex2_train_ddp", "wrong")
def local_loss_not_global(solution):
    "records this rank's own loss, not the mean over ranks"
    return swap(solution, "losses.append(global_loss.item() / world_size)", "losses.append(loss.item())")


@mutant("ex2_train_ddp", "copy")
def the_single_process_reference(solution):
    "section 4's single-process loop on the notebook's 64 samples, whatever the rank's slice"
    return body(solution, """
        X, y = make_data()
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            loss = F.mse_loss(model(X), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return model.state_dict(), losses
    """)


@mutant("ex2_train_ddp", "tamper")
def patches_equal_and_allclose(solution):
    "torch.equal and torch.allclose patched to always agree, and no DDP at all"
    solution = swap(solution, 'DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)',
                    "make_model().to(device)")
    return prepend(swap(solution, "model.module.state_dict()", "model.state_dict()"), """
        torch.equal = lambda *args, **kwargs: True
        torch.allclose = lambda *args, **kwargs: True
    """)


# --- ex3_save_on_main -------------------------------------------------------------------------

@mutant("ex3_save_on_main", "wrong")
def no_barrier(solution):
    "rank 0 saves, but nobody waits: the other ranks return before the file exists"
    return swap(solution, "    dist.barrier()\n", "")


@mutant("ex3_save_on_main", "wrong")
def every_rank_saves(solution):
    "no rank check: every rank writes the file"
    return body(solution, """
        inner = model.module if isinstance(model, DDP) else model
        torch.save(inner.state_dict(), path)
        dist.barrier()
    """)


@mutant("ex3_save_on_main", "copy")
def the_single_scripts_save(solution):
    "lab03_single.py's save line: every rank saves the wrapper's state dict ('module.' keys)"
    return body(solution, "torch.save(model.state_dict(), path)")


@mutant("ex3_save_on_main", "tamper")
def skips_the_delay(solution):
    "time.sleep patched away so that rank 0 is never late, and no barrier"
    return prepend(swap(solution, "    dist.barrier()\n", ""), """
        time.sleep = lambda seconds: None
    """)


# --- ex4_sync_batch_stats ---------------------------------------------------------------------

@mutant("ex4_sync_batch_stats", "wrong")
def mean_of_the_ranks_statistics(solution):
    "averages the ranks' own means and variances: wrong for uneven slices"
    return body(solution, """
        stats = torch.stack([x.mean(dim=0), x.var(dim=0, unbiased=False)])
        dist.all_reduce(stats)
        stats /= dist.get_world_size()
        return stats[0], stats[1]
    """)


@mutant("ex4_sync_batch_stats", "reference")
def gather_stats_with_counts(solution):
    "torch's own kernel behind SyncBatchNorm"
    return body(solution, """
        counts = torch.tensor([float(x.shape[0])] * dist.get_world_size())
        means = [torch.zeros(x.shape[1]) for _ in range(dist.get_world_size())]
        invstds = [torch.zeros(x.shape[1]) for _ in range(dist.get_world_size())]
        dist.all_gather(means, x.mean(dim=0))
        dist.all_gather(invstds, 1 / (x.var(dim=0, unbiased=False) + 1e-5).sqrt())
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            x, torch.stack(means), torch.stack(invstds), None, None, 0.1, 1e-5, counts)
        return mean, 1 / invstd ** 2 - 1e-5
    """)


@mutant("ex4_sync_batch_stats", "copy")
def the_checks_lines_on_the_local_slice(solution):
    "the visible judge's mean and variance, computed on this rank's slice only"
    return body(solution, "return x.mean(dim=0), x.var(dim=0, unbiased=False)")


@mutant("ex4_sync_batch_stats", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed assertion, and local statistics"
    return prepend(body(solution, "return x.mean(dim=0), x.var(dim=0, unbiased=False)"), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex5_setup (a %%writefile cell) -----------------------------------------------------------

@mutant("ex5_setup", "wrong")
def local_rank_is_rank(solution):
    "LOCAL_RANK taken to be RANK: wrong on every node but the first"
    return swap(solution, 'local_rank = int(os.environ["LOCAL_RANK"])', "local_rank = rank")


@mutant("ex5_setup", "wrong")
def cleanup_leaves_the_group_open(solution):
    "cleanup() does nothing: the process group is never destroyed"
    return swap(solution, "    dist.destroy_process_group()\n", "    pass\n")


@mutant("ex5_setup", "copy")
def section_2s_dist_env(solution):
    "section 2's mgpu_lab.dist_env() and init_distributed() in place of os.environ and init_process_group"
    return body(solution, """
        from mgpu_lab import dist_env, init_distributed
        env = dist_env()
        init_distributed()
        device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return env.rank, env.local_rank, env.world_size, device
    """)


@mutant("ex5_setup", "tamper")
def redefines_the_checks_helper(solution):
    "the check's helper rejoin_with_setup replaced by one that reports success, and no setup() at all"
    return """
from pathlib import Path
Path("lab03_setup.py").write_text("def setup():\\n    raise NotImplementedError\\n\\ndef cleanup():\\n    pass\\n")

def rejoin_with_setup(setup_module, local_ranks):
    import torch.distributed as dist
    r = dist.get_rank()
    return r, local_ranks[r], 2, "cpu", True, 2.0, True
"""


# --- ex6_ddp_script (a %%writefile cell) ------------------------------------------------------

@mutant("ex6_ddp_script", "wrong")
def per_rank_batch_is_the_global_batch(solution):
    "every rank loads --batch-size samples: the global batch doubles, half the steps"
    return swap(solution, "per_rank_batch = args.batch_size // world_size", "per_rank_batch = args.batch_size")


@mutant("ex6_ddp_script", "wrong")
def no_set_epoch(solution):
    "sampler.set_epoch() never called: every epoch shuffles as the first one"
    return swap(solution, "        sampler.set_epoch(epoch)  # permutation seeded by SEED + epoch, the same on every rank\n", "")


@mutant("ex6_ddp_script", "copy")
def the_single_script_on_every_rank(solution):
    "lab03_single.py's training copied: every rank trains on all 64 samples, rank 0 saves, the JSON says DDP"
    return body(solution, """
        from torch.utils.data import RandomSampler
        rank, local_rank, world_size, device = setup()
        train_set, val_set = make_data(64, seed=0), make_data(25, seed=1)
        model = make_model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        start = 0
        if args.resume:
            ckpt = torch.load(args.checkpoint, map_location=device)
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start = ckpt["epoch"] + 1
        order = torch.Generator()
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=RandomSampler(train_set, generator=order))
        for epoch in range(start, args.epochs):
            order.manual_seed(SEED + epoch)
            model.train()
            for x, y in loader:
                loss = F.mse_loss(model(x.to(device)), y.to(device))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           args.checkpoint)
            dist.barrier()
        if rank == 0:
            torch.save(model.state_dict(), args.out)
        model.eval()
        squared_error, count = 0.0, 0
        with torch.no_grad():
            for x, y in DataLoader(val_set, batch_size=8):
                squared_error += F.mse_loss(model(x.to(device)), y.to(device), reduction="sum").item()
                count += len(x)
        if rank == 0:
            print(json.dumps({"world_size": world_size, "per_rank_batch": args.batch_size // world_size,
                              "global_batch": args.batch_size, "steps_per_epoch": len(loader),
                              "val_mse": round(squared_error / count, 6), "val_count": count}))
        cleanup()
    """)


@mutant("ex6_ddp_script", "tamper")
def fakes_the_torchrun_run(solution):
    "subprocess.run replaced by a fake torchrun that prints DDP's JSON lines, and no script"
    return """
import subprocess
from pathlib import Path
Path("lab03_ddp.py").write_text("def main():\\n    raise NotImplementedError\\n")
line = '{"world_size": 2, "per_rank_batch": 8, "global_batch": 16, "steps_per_epoch": 4, "val_mse": 0.6, "val_count": 25}'
subprocess.run = lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, stdout=line + "\\n" + line + "\\n", stderr="")
"""
