"""Mutants of lab 03: shard indices for an evaluation in order, DDP training on shards of any size, saving once
per node, batch statistics over a group of ranks, setup()/cleanup() under torchrun or mpirun, and the DDP script
under torchrun.

Issue 29's attacks on the "must not call" guard (a reference reached past it) are kind ``wrong``:
they must score 0 because the reference computes something else than the exercise asks, whether or
not the guard sees them, and tests/test_mutants.py counts a ``reference`` kill only when it does."""
from . import body, mutant, prepend, swap

LAB = "03_ddp_and_launching"

STRIDED = """
    indices = list(range(n))
    if drop_last:
        per_rank = n // world_size
        indices = indices[: per_rank * world_size]
    else:
        per_rank = -(-n // world_size)
        while len(indices) < per_rank * world_size:
            indices += indices[: per_rank * world_size - len(indices)]
    return indices[rank::world_size]
"""


# --- ex1_shard_indices ------------------------------------------------------------------------

@mutant("ex1_shard_indices", "wrong")
def strided_like_distributed_sampler(solution):
    "DistributedSampler's shards by hand (the lab's old answer): every world_size-th index, the results interleaved"
    return body(solution, STRIDED)


@mutant("ex1_shard_indices", "wrong",
        message="pads with the first (padded length - n) indices once: with fewer samples than the padding needs "
                "(1 sample on 4 ranks) the last ranks get too few indices; DistributedSampler repeats the list from "
                "its start as many times as it takes",
        section="3. Sharding the data: `DistributedSampler`",
        learner="learnB, 2026-12-05, first attempt: attempts/lab03/ex1_shard_indices-1.py")
def pads_once(solution):
    "the padding taken once from the start of the list (indices[:pad]): too short when the padding is longer than the data"
    return body(solution, """
        indices = list(range(n))
        if drop_last:
            per_rank = n // world_size
            indices = indices[:per_rank * world_size]
        else:
            per_rank = -(-n // world_size)
            indices += indices[:per_rank * world_size - n]
        return indices[rank * per_rank:(rank + 1) * per_rank]
    """)


@mutant("ex1_shard_indices", "reference")
def the_old_reference_helper(solution):
    "the graded cell's old helper `reference`, which wraps DistributedSampler, defined and called"
    return prepend(body(solution, "return reference(n, rank, world_size, drop_last)"), """
        def reference(n, rank, world_size, drop_last=False):
            return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))
    """)


@mutant("ex1_shard_indices", "wrong")
def a_child_python_computes_it(solution):
    "issue 29 attack, a child Python: DistributedSampler's lists from a subprocess (one, for every case); strided"
    return prepend(body(solution, """
        key = (n, rank, world_size, drop_last)
        if key not in FROM_CHILD:
            import json, subprocess, sys
            code = ("import json; from torch.utils.data import DistributedSampler as S; "
                    "print(json.dumps([[n, r, w, d, list(S(range(n), num_replicas=w, rank=r, shuffle=False, drop_last=d))] "
                    "for n in range(1, 40) for w in range(1, 9) for r in range(w) for d in (False, True) if n >= w or not d]))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            FROM_CHILD.update({tuple(k[:4]): k[4] for k in json.loads(out.stdout)})
        return FROM_CHILD[key]
    """), "FROM_CHILD = {}")


@mutant("ex1_shard_indices", "wrong")
def linecache_shows_the_guard_an_instructors_cell(solution):
    "issue 29 attack, linecache: this cell's cached source swapped for a given cell's, then DistributedSampler; strided"
    return body(solution, """
        import linecache
        import torch.utils.data as data
        cells = {k: v for k, v in linecache.cache.items() if isinstance(v, tuple) and len(v) == 4}
        given = next((v for v in cells.values() if "def make_data(n=64" in "".join(v[2])), None)
        for key, value in cells.items():
            if given is not None and "def shard_indices" in "".join(value[2]):
                linecache.cache[key] = given
        sampler = vars(data)["DistributedSampler"]
        return list(sampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))
    """)


@mutant("ex1_shard_indices", "copy")
def copies_the_demos_sampler_line(solution):
    "section 3's demo line: a DistributedSampler, listed (strided)"
    return body(solution, """
        return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))
    """)


@mutant("ex1_shard_indices", "tamper")
def patches_the_sampler(solution):
    "DistributedSampler made to agree with a wrong answer (strided shards)"
    return prepend(body(solution, STRIDED), """
        DistributedSampler.__iter__ = lambda self: iter(shard_indices(len(self.dataset), self.rank, self.num_replicas))
    """)


# --- ex2_train_ddp ----------------------------------------------------------------------------

@mutant("ex2_train_ddp", "wrong")
def plain_ddp(solution):
    "DDP's average as it is (the lab's old answer): right for equal shards, each sample of a small shard counts more"
    solution = swap(solution, "        (loss * share).backward()  # DDP averages the gradients across ranks here",
                    "        loss.backward()")
    return solution


@mutant("ex2_train_ddp", "wrong")
def mean_of_the_ranks_losses(solution):
    "the right step, but the logged global loss is the mean of the ranks' means"
    return swap(solution, """        global_loss = loss.detach() * len(x_local)  # this rank's sum of squared errors
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / n_total.item())""", """        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)""")


@mutant("ex2_train_ddp", "wrong",
        message="scales each rank's loss by n_r / N: DDP still divides the summed gradients by world_size, so each "
                "step is the full batch's divided by world_size; the factor is n_r * world_size / N",
        section="4. DDP from the notebook, checked against one process",
        learner="learnB, 2026-12-05, considered: attempts/lab03/ex2_train_ddp-1.py")
def share_without_the_world_size(solution):
    "each rank's loss scaled by its share n_r / N, forgetting that DDP then divides by world_size"
    return swap(solution, "share = len(x_local) * world_size / n_total.item()", "share = len(x_local) / n_total.item()")


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
    "torch.equal and torch.allclose patched to always agree, and plain DDP"
    return prepend(plain_ddp(solution), """
        torch.equal = lambda *args, **kwargs: True
        torch.allclose = lambda *args, **kwargs: True
    """)


# --- ex3_save_on_each_node --------------------------------------------------------------------

@mutant("ex3_save_on_each_node", "wrong")
def global_rank_0_only(solution):
    "rank 0 of the whole job saves (the lab's old answer): the other nodes have no checkpoint"
    return swap(solution, 'if int(os.environ["LOCAL_RANK"]) == 0:', "if dist.get_rank() == 0:")


@mutant("ex3_save_on_each_node", "wrong")
def no_barrier(solution):
    "local rank 0 saves, but nobody waits: the other ranks return before the file exists"
    return swap(solution, "    dist.barrier()  # nobody returns (and loads) before the files are complete\n", "")


@mutant("ex3_save_on_each_node", "wrong")
def every_rank_saves(solution):
    "no rank check: every rank of a node writes the node's file, the last writer wins"
    return body(solution, """
        inner = model.module if isinstance(model, DDP) else model
        torch.save(inner.state_dict(), path)
        dist.barrier()
    """)


@mutant("ex3_save_on_each_node", "copy")
def the_single_scripts_save(solution):
    "lab03_single.py's save line: every rank saves the wrapper's state dict ('module.' keys)"
    return body(solution, "torch.save(model.state_dict(), path)")


@mutant("ex3_save_on_each_node", "tamper")
def skips_the_delay(solution):
    "time.sleep patched away so that no rank is ever late, and no barrier"
    return prepend(no_barrier(solution), """
        time.sleep = lambda seconds: None
    """)


# --- ex4_sync_batch_stats ---------------------------------------------------------------------

WORLD = """
    count = torch.tensor([float(x.shape[0])], device=x.device)
    total, total_sq = x.sum(dim=0), (x * x).sum(dim=0)
    for t in (count, total, total_sq):
        dist.all_reduce(t)
    mean = total / count
    return mean, total_sq / count - mean * mean
"""


@mutant("ex4_sync_batch_stats", "wrong")
def over_the_whole_world(solution):
    "the statistics of every rank's rows (the lab's old answer): the groups ignored"
    return body(solution, WORLD)


@mutant("ex4_sync_batch_stats", "wrong")
def mean_of_the_groups_statistics(solution):
    "averages the group's ranks' own means and variances: wrong for slices of different sizes"
    return swap(solution, """    count = torch.tensor([float(x.shape[0])], device=x.device)
    total = x.sum(dim=0)
    total_sq = (x * x).sum(dim=0)
    for t in (count, total, total_sq):
        dist.all_reduce(t, group=mine)
    mean = total / count
    return mean, total_sq / count - mean * mean""", """    stats = torch.stack([x.mean(dim=0), x.var(dim=0, unbiased=False)])
    dist.all_reduce(stats, group=mine)
    stats /= group_size
    return stats[0], stats[1]""")


@mutant("ex4_sync_batch_stats", "reference")
def gather_stats_with_counts(solution):
    "torch's own kernel behind SyncBatchNorm, over the whole world"
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
def torchrun_only(solution):
    "torchrun's variables only (the lab's old answer): under mpirun, a KeyError"
    return body(solution, """
        rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
        return rank, local_rank, world_size, device
    """)


@mutant("ex5_setup", "wrong")
def local_rank_is_rank(solution):
    "LOCAL_RANK taken to be RANK: wrong on every node but the first"
    return swap(solution, "    rank, local_rank, world_size = (int(os.environ[name]) for name in names)",
                "    rank, _, world_size = (int(os.environ[name]) for name in names)\n    local_rank = rank")


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

def rejoin_with_setup(setup_module, launcher, local_ranks):
    import torch.distributed as dist
    r = dist.get_rank()
    return r, local_ranks[r], 2, "cpu", 3.0
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


@mutant("ex6_ddp_script", "wrong",
        message="the validation set evaluated over its DistributedSampler with the padding kept: 25 samples on 2 ranks "
                "are padded to 26, sample 0 counted twice (val_count 26); drop the repeated positions before the "
                "all-reduce",
        section="What changes, line by line",
        learner="learnG, 2026-12-05, first attempt: attempts/lab03/ex6_ddp_script-1.py")
def counts_the_validation_padding(solution):
    "the validation sampler's padding repeats all-reduced with the real samples: 26 counted, sample 0 twice"
    return swap(solution, "errors = torch.cat(errors)[real.to(device)]", "errors = torch.cat(errors)")


@mutant("ex6_ddp_script", "wrong",
        message="the validation sampler with drop_last=True: the tail is dropped instead of the padding, 24 of the 25 "
                "samples counted; every sample counts once, so only the repeats go",
        section="3. Sharding the data: `DistributedSampler`",
        learner="learnG, 2026-12-05, considered: attempts/lab03/ex6_ddp_script-2.py")
def drops_the_validation_tail(solution):
    "the validation DistributedSampler with drop_last=True: 24 of 25 samples evaluated"
    return swap(solution, "DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)",
                "DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)")


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


@mutant("ex6_ddp_script", "copy")
def the_single_script_with_its_own_data(solution):
    "lab03_single.py's make_data copied into the script (none of the check's data), every rank training on all 64"
    return swap(the_single_script_on_every_rank(solution),
                "    train_set, val_set = make_data(64, seed=0), make_data(25, seed=1)\n",
                "    from torch.utils.data import TensorDataset\n"
                "    def own_data(n, seed):\n"
                "        g = torch.Generator().manual_seed(seed)\n"
                "        X = torch.randn(n, 8, generator=g)\n"
                "        return TensorDataset(X, torch.sin(X.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g))\n"
                "    train_set, val_set = own_data(64, seed=0), own_data(25, seed=1)\n")


@mutant("ex6_ddp_script", "tamper")
def fakes_the_torchrun_run(solution):
    "torchrun (torch.distributed.run.main, which the check runs forked from the kernel) replaced by a fake that prints DDP's JSON lines, and no script"
    return """
import torch.distributed.run
from pathlib import Path
Path("lab03_ddp.py").write_text("def main():\\n    raise NotImplementedError\\n")
line = '{"world_size": 2, "per_rank_batch": 8, "global_batch": 16, "steps_per_epoch": 4, "val_mse": 0.6, "val_count": 25}'
torch.distributed.run.main = lambda args=None: print(line + "\\n" + line)
"""
