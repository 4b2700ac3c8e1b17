"""Mutants of lab 08: a checkpoint folder with a `latest` pointer, resumable state with the data pipeline's
generator, an evaluation gathered in dataset order, a cross-rank check that names the parameters, an unseen hang
diagnosed and fixed, a sharded checkpoint resumed on another number of ranks.

Attacks on the "must not call" guard (exec of a string, a worker thread, a second copy of a library module) are of
kind ``wrong``: what kills them is the twist (the reference computes something else), which the framework reports
as a failed check, not as a forbidden call."""
from . import body, mutant, prepend, swap

LAB = "08_faults"


# --- ex1_atomic_save ---------------------------------------------------------------

@mutant("ex1_atomic_save", "wrong")
def pointer_before_checkpoint(solution):
    "the pointer first, then the checkpoint: the failed save leaves latest naming a file that is not there"
    return swap(solution, """    write(folder / name, lambda f: torch.save(obj, f))          # the checkpoint first,
    write(folder / "latest", lambda f: f.write(name.encode()))  # then the pointer to it
""", """    write(folder / "latest", lambda f: f.write(name.encode()))
    write(folder / name, lambda f: torch.save(obj, f))
""")


@mutant("ex1_atomic_save", "wrong")
def deletes_old_checkpoints_first(solution):
    "makes room first (keeps keep - 1, then writes): a failed save has already deleted a good checkpoint"
    return swap(swap(solution, """    for old in sorted(int(p.stem[5:]) for p in folder.glob("step_*.pt"))[:-keep]:
        (folder / f"step_{old:06d}.pt").unlink()                # and only then the old ones go
""", ""), """    name = f"step_{step:06d}.pt"
""", """    name = f"step_{step:06d}.pt"
    for old in sorted(int(p.stem[5:]) for p in folder.glob("step_*.pt"))[:len(list(folder.glob("step_*.pt"))) - keep + 1]:
        (folder / f"step_{old:06d}.pt").unlink()
""")


@mutant("ex1_atomic_save", "reference")
def calls_save_checkpoint_through_an_alias(solution):
    "mgpu_lab.save_checkpoint under another name, for the checkpoint and the pointer"
    return body(solution, """
        from mgpu_lab import save_checkpoint as write
        name = f"step_{step:06d}.pt"
        write(folder / name, **obj)
        write(folder / "latest", name=name)
    """)


@mutant("ex1_atomic_save", "wrong")
def save_checkpoint_defined_by_exec(solution):
    "attack (exec of a literal string): atomic_save defined in exec'd code on mgpu_lab.save_checkpoint, which writes "
    "one pickled file per call: the pointer is no text, nothing is rotated"
    return ('exec("def atomic_save(obj, folder, step, keep=2):\\n"\n'
            '     "    from mgpu_lab import save_checkpoint\\n"\n'
            '     "    name = f\'step_{step:06d}.pt\'\\n"\n'
            '     "    save_checkpoint(str(folder) + \'/\' + name, **obj)\\n"\n'
            '     "    save_checkpoint(str(folder) + \'/latest\', name=name)\\n")\n')


@mutant("ex1_atomic_save", "copy")
def saves_in_place_as_the_gift_cell(solution):
    "section 1's torch.save(obj, path) for both files: not atomic, a failed save leaves half a checkpoint"
    return body(solution, """
        name = f"step_{step:06d}.pt"
        torch.save(obj, folder / name)
        (folder / "latest").write_text(name)
        for old in sorted(int(p.stem[5:]) for p in folder.glob("step_*.pt"))[:-keep]:
            (folder / f"step_{old:06d}.pt").unlink()
    """)


@mutant("ex1_atomic_save", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over in-place saves"
    return prepend(saves_in_place_as_the_gift_cell(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex2_resume ----------------------------------------------------------------------

def _checkpoint(solution, save, restore):
    return body(body(solution, save), restore)   # the first region replaced, the second is now the first


@mutant("ex2_resume", "wrong")
def forgets_the_random_state(solution):
    "model, optimizer and data order only: dropout draws other masks after resuming"
    return _checkpoint(solution, """
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data_rng": data_rng.get_state()}
    """, """
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        data_rng.set_state(ckpt["data_rng"])
    """)


@mutant("ex2_resume", "wrong")
def forgets_the_data_generator(solution):
    "model, optimizer and the global RNG (what TrainState saves): the resumed run reads other batches"
    return _checkpoint(solution, """
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
    """, """
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
    """)


@mutant("ex2_resume", "reference")
def uses_train_state(solution):
    "TrainState's state_dict and load, the class it re-implements (the global generators only)"
    return _checkpoint(solution, """
        return TrainState(model, optimizer).state_dict()
    """, """
        path = Path(tempfile.mkdtemp()) / "state.pt"
        torch.save(ckpt, path)
        TrainState(model, optimizer).load(path)
    """)


@mutant("ex2_resume", "wrong")
def train_state_from_a_second_copy_of_its_module(solution):
    "attack (a second copy of the library module, loaded from its file): its unguarded TrainState, which saves "
    "the global generators and not the data pipeline's"
    return """
import importlib.util
import mgpu_lab.training.train_state as _ts
_spec = importlib.util.spec_from_file_location("mgpu_lab.training.train_state_copy", _ts.__file__)
_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_copy)


def my_checkpoint(model, optimizer, data_rng):
    return _copy.TrainState(model, optimizer).state_dict()


def my_restore(ckpt, model, optimizer, data_rng):
    path = Path(tempfile.mkdtemp()) / "state.pt"
    torch.save(ckpt, path)
    _copy.TrainState(model, optimizer).load(path)
""".lstrip()


@mutant("ex2_resume", "copy")
def reseeds_as_the_demo_does(solution):
    "section 2's torch.manual_seed(1) instead of restoring the generators"
    return _checkpoint(solution, """
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    """, """
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.manual_seed(1)
    """)


@mutant("ex2_resume", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over a checkpoint without the data generator"
    return prepend(forgets_the_data_generator(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex3_gather_uneven --------------------------------------------------------------

@mutant("ex3_gather_uneven", "wrong",
        message="gathers and trims, then puts rank 0's predictions first and rank 1's after them; an evaluation "
                "sampler gives rank r the samples r, r + N, r + 2N, ..., so dataset order interleaves the ranks: "
                "sample i comes from rank i mod N",
        section="Exercise 3 — fix Program B: gather an evaluation in dataset order (3 points)")
def concatenates_in_rank_order(solution):
    "exchanges the lengths, pads, gathers and trims, but concatenates rank 0's samples, then rank 1's: not dataset order"
    return swap(solution, """    result = torch.empty(sum(sizes), dtype=t.dtype, device=t.device)
    for r, (o, s) in enumerate(zip(out, sizes)):
        result[r::world] = o[:s]                 # rank r held samples r, r + N, r + 2N, ...
    return result
""", """    return torch.cat([o[:s] for o, s in zip(out, sizes)])
""")


@mutant("ex3_gather_uneven", "reference")
def all_gather_object_through_getattr(solution):
    "all_gather_object reached through getattr of a built name"
    return body(solution, """
        out = [None] * world
        getattr(dist, "all_gather" + "_object")(out, t.cpu())
        return torch.cat(out).to(t.device)
    """)


@mutant("ex3_gather_uneven", "wrong")
def all_gather_object_in_a_worker_thread(solution):
    "attack (a worker thread calls the reference, out of the guard's sight): all_gather_object gives every "
    "rank's list in rank order, not the dataset's"
    return body(solution, """
        from concurrent.futures import ThreadPoolExecutor
        out = [None] * world
        with ThreadPoolExecutor(1) as pool:
            pool.submit(vars(dist)["all_gather_object"], out, t.cpu()).result()
        return torch.cat(out).to(t.device)
    """)


@mutant("ex3_gather_uneven", "copy")
def copies_program_b(solution):
    "Program B's all_gather: needs equal shapes (gloo aborts)"
    return body(solution, """
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        return torch.cat(out)
    """)


@mutant("ex3_gather_uneven", "tamper")
def ipython_hides_the_failure(solution):
    "IPython's exception hook set to swallow the failed check, over Program B's all_gather"
    return prepend(copies_program_b(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex4_weights_agree ---------------------------------------------------------------

@mutant("ex4_weights_agree", "wrong",
        message="compares with rank 0's weights and returns each rank's own verdict: rank 0 names nothing, the rank "
                "that differs names the parameter, and the ranks take different branches (Program A again); every "
                "rank must return the same list",
        section="Program A — a collective inside `if rank == 0`")
def each_rank_answers_for_itself(solution):
    "compares with rank 0's weights but returns the local verdict: rank 0 names nothing, rank 1 the culprit"
    return body(solution, """
        named = list(model.named_parameters())
        names = []
        for name, p in named:
            first = p.detach().clone()
            dist.broadcast(first, 0)
            if not torch.equal(first, p.detach()):
                names.append(name)
        return sorted(names)
    """)


@mutant("ex4_weights_agree", "wrong",
        message="compares the whole model at once and answers yes or no: a yes/no says that something broke, the "
                "names say where to look; compare each parameter's part of the MIN and MAX all-reduced tensor",
        section="Exercise 4 — a cross-rank consistency check that names the culprits (2 points)")
def one_verdict_for_the_whole_model(solution):
    "the whole model compared at once (MIN and MAX agree?): a yes/no, no names"
    return body(solution, """
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return [] if torch.equal(lo, hi) else ["the model"]
    """)


@mutant("ex4_weights_agree", "wrong")
def ddp_verification_defined_by_exec(solution):
    "attack (exec of a literal string): torch's own cross-rank check of DDP, which compares the parameters' shapes, "
    "not their values"
    return ('exec("def disagreeing_parameters(model):\\n"\n'
            '     "    dist._verify_params_across_processes(dist.group.WORLD, list(model.parameters()))\\n"\n'
            '     "    return []\\n")\n')


@mutant("ex4_weights_agree", "copy")
def sums_as_program_a_averages(solution):
    "Program A's all_reduce of a sum, compared with world x its own, each rank its own verdict: differences cancel"
    return body(solution, """
        names = []
        for name, p in model.named_parameters():
            total = p.detach().clone()
            dist.all_reduce(total)
            if not torch.equal(total, p.detach() * dist.get_world_size()):
                names.append(name)
        return sorted(names)
    """)


@mutant("ex4_weights_agree", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over an answer of nothing"
    return prepend(body(solution, "return []"), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex5_diagnose_hang -----------------------------------------------------------------

PROGRAM_F_BODY = """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    for step in range(1, max_steps + 1):
        x = torch.randn(16, 4, generator=data)
        y = x @ W_TRUE.T + 0.5 * torch.randn(16, 1, generator=data)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad); p.grad /= world
        opt.step()
        {stop}
    return step, model.weight.detach(), model.bias.detach()
"""


def _fixed(solution, stop):
    """The solution cell with program_f_fixed's body replaced (the diagnosis kept)."""
    head, tail = solution.split("def program_f_fixed", 1)
    fixed = "def program_f_fixed" + tail
    return head + body(fixed, PROGRAM_F_BODY.replace("{stop}", stop))


@mutant("ex5_diagnose_hang", "wrong",
        message="all-reduces a 'converged' flag with MAX, as the preemption notice is shared: the ranks stop together, "
                "but as soon as one rank's own loss is below the threshold; the rule is the mean of the ranks' "
                "losses (all-reduce the loss, divide by N)",
        section="Program F, and Exercise 5 — diagnose a hang the lab has not shown (design, 4 points)")
def stops_when_any_rank_converged(solution):
    "all-reduces a 'converged' flag with MAX: every rank stops together, but on the wrong rule"
    return _fixed(solution, """done = torch.tensor([float(loss.item() < threshold)])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break""")


@mutant("ex5_diagnose_hang", "copy")
def copies_program_f(solution):
    "Program F itself: each rank stops on its own loss, and the other waits forever"
    return _fixed(solution, """if loss.item() < threshold:
            break""")


@mutant("ex5_diagnose_hang", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over a wrong diagnosis"
    return prepend(solution.replace('f_rank, f_op, f_collective = 1, "all_reduce", 44',
                                    'f_rank, f_op, f_collective = 0, "all_reduce", 0'), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex6_reshard ------------------------------------------------------------------------

@mutant("ex6_reshard", "wrong")
def gathers_everything_to_rank_0(solution):
    "full state dicts gathered to rank 0 and torch.save'd: resumes, but nothing is sharded"
    return body(body(solution, """
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optimizer, options=full)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            torch.save({"model": model_state, "optimizer": optim_state, "step": step}, Path(path) / "full.pt")
        dist.barrier()
    """), """
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        state = torch.load(Path(path) / "full.pt", weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        return state["step"]
    """)


@mutant("ex6_reshard", "wrong",
        message="saves and loads model.state_dict() and optimizer.state_dict(): a freshly built optimizer holds no "
                "state yet, so dcp.load has no Adam state to fill in and Adam starts over; get_state_dict makes it "
                "(by name), set_state_dict puts it back",
        section="6. Sharded checkpoints: `torch.distributed.checkpoint`",
        learner="learnD, 2026-12-05, considered: attempts/lab08/ex6_reshard-1.py")
def plain_state_dicts_of_a_fresh_optimizer(solution):
    "model.state_dict() and a fresh optimizer's state_dict() given to DCP: the optimizer has no state to load into"
    return body(body(solution, """
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, checkpoint_id=path)
    """), """
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        return state["step"]
    """)


@mutant("ex6_reshard", "copy")
def saves_the_model_as_the_demo_saves_its_rows(solution):
    "section 6's dcp.save of a dict of tensors, with the model only: Adam starts over"
    return body(body(solution, """
        dcp.save({"model": model.state_dict(), "step": step}, checkpoint_id=path)
    """), """
        state = {"model": model.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        return state["step"]
    """)


@mutant("ex6_reshard", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over a model-only checkpoint"
    return prepend(saves_the_model_as_the_demo_saves_its_rows(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
