"""Mutants of lab 08: atomic save, resumable state, uneven all-gather, cross-rank check,
an unseen hang diagnosed and fixed, a sharded checkpoint resumed on another number of ranks."""
from . import body, mutant, prepend

LAB = "08_faults"


# --- ex1_atomic_save ---------------------------------------------------------------

@mutant("ex1_atomic_save", "wrong")
def renames_without_fsync(solution):
    "temporary file and atomic rename, but never fsynced: the rename can outlive the bytes"
    return body(solution, """
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    """)


@mutant("ex1_atomic_save", "reference")
def calls_save_checkpoint_through_an_alias(solution):
    "mgpu_lab.save_checkpoint under another name"
    return body(solution, """
        from mgpu_lab import save_checkpoint as write
        write(path, **obj)
    """)


@mutant("ex1_atomic_save", "copy")
def saves_in_place_as_the_gift_cell(solution):
    "section 1's torch.save(obj, path): not atomic, a failed save destroys the previous file"
    return body(solution, "torch.save(obj, path)")


@mutant("ex1_atomic_save", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over an in-place save"
    return prepend(body(solution, "torch.save(obj, path)"), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex2_resume ----------------------------------------------------------------------

@mutant("ex2_resume", "wrong")
def forgets_the_random_state(solution):
    "model and optimizer only: dropout draws other masks after resuming"
    return body(body(solution, """
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    """), """
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    """)


@mutant("ex2_resume", "reference")
def uses_train_state(solution):
    "TrainState's state_dict, the class it re-implements"
    return body(solution, """
        return TrainState(model, optimizer).state_dict()
    """)


@mutant("ex2_resume", "copy")
def reseeds_as_the_demo_does(solution):
    "section 2's torch.manual_seed(1) instead of restoring the generator"
    return body(body(solution, """
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    """), """
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.manual_seed(1)
    """)


@mutant("ex2_resume", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over a checkpoint without the RNG"
    return prepend(forgets_the_random_state(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex3_gather_uneven --------------------------------------------------------------

@mutant("ex3_gather_uneven", "wrong")
def pads_but_never_trims(solution):
    "exchanges the lengths and pads, but returns the padding too"
    return body(solution, """
        n = torch.tensor([t.numel()], device=t.device)
        sizes = [torch.empty_like(n) for _ in range(world)]
        dist.all_gather(sizes, n)
        padded = torch.zeros(int(max(sizes)), dtype=t.dtype, device=t.device)
        padded[: t.numel()] = t
        out = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(out, padded)
        return torch.cat(out)
    """)


@mutant("ex3_gather_uneven", "reference")
def all_gather_object_through_getattr(solution):
    "all_gather_object reached through getattr of a built name"
    return body(solution, """
        out = [None] * world
        getattr(dist, "all_gather" + "_object")(out, t.cpu())
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

@mutant("ex4_weights_agree", "wrong")
def each_rank_answers_for_itself(solution):
    "compares with rank 0's weights but returns the local verdict: rank 0 says True, rank 1 False"
    return body(solution, """
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        first = flat.clone()
        dist.broadcast(first, 0)
        return bool(torch.equal(first, flat))
    """)


@mutant("ex4_weights_agree", "reference")
def uses_all_gather_object(solution):
    "all_gather_object, which the exercise rules out"
    return body(solution, """
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).cpu()
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, flat)
        return all(torch.equal(out[0], o) for o in out)
    """)


@mutant("ex4_weights_agree", "copy")
def sums_as_program_a_averages(solution):
    "Program A's all_reduce of a sum, compared with world x its own, each rank its own verdict: differences cancel"
    return body(solution, """
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        total = flat.clone()
        dist.all_reduce(total)
        return bool(torch.equal(total, flat * dist.get_world_size()))
    """)


@mutant("ex4_weights_agree", "tamper")
def hides_the_failure_from_ipython(solution):
    "IPython's exception hook set to swallow the failed check, over an answer of True"
    return prepend(body(solution, "return True"), """
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


@mutant("ex5_diagnose_hang", "wrong")
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
