"""The pieces combined as a practitioner combines them, on 2 gloo ranks.

For each wrapper (torch DDP, NaiveDDP, BucketedDDP, mgpu_lab's FSDP, torch's
fully_shard) and each way of training (plain steps, GradientAccumulator with
uneven micro-batches, clipping and a flushed last window, LossScaler with fp16
autocast on the CPU, ShardedOptimizer where it applies, an LR scheduler):

* the weights equal one process trained on the full batch (the reference runs
  in the test process);
* a run that saves a TrainState, takes one more step and is killed, then is
  resumed in fresh processes, ends bit for bit equal to the uninterrupted run.

Three launches run every case: uninterrupted, save-then-die, resume. The loop
has no call after backward: the wrappers finish their communication with it.

Then DTensor models and pipeline stages (FSDP x TP on a 2 x 2 mesh, TP alone, two
pipeline stages; accumulation over uneven micro-batches, bf16 autocast, clipping, a
scheduler), each saved, killed and resumed on *another* layout (4 ranks to 2 and back,
one-file and sharded checkpoints), against one process on the full batch; and the library
guide's loop on a mesh, extracted from docs/LIBRARY.md, resumed on another layout.
"""
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # noqa: F401  (loaded once here, not in every rank)
import torch.distributed.fsdp  # noqa: F401
from torch import nn

from conftest import VOCAB, WRAPPERS, TiedNet, lm_loss, wrap
from mgpu_lab import GradientAccumulator, LaunchError, LossScaler, ShardedOptimizer, TrainState, launch
from mgpu_lab.parallel.wrappers import model_state_dict

SEQ, WORLD = 4, 2
STEPS, SAVE_AT = 4, 2        # optimizer steps; the checkpoint is written after step 2
K, MICRO = 3, 11             # accumulation: windows of 3 micro-batches, the 4th window flushed with 2
SCENARIOS = ("plain", "accumulate", "loss_scaler", "sharded_optimizer", "scheduler")
CASES = [(w, s) for w in WRAPPERS for s in SCENARIOS
         if not (s == "sharded_optimizer" and w in ("fsdp", "fully_shard"))]  # ZeRO-1 under ZeRO-3: no


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _step_batch(step, rank):
    """Plain steps: 8 sequences a step, rank r takes its half."""
    x, y = _tokens(8, 1000 + step)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def _micro_batch(j, rank):
    """Accumulation: micro-batch j of rank r holds 1 to 3 sequences, uneven across ranks and steps."""
    return _tokens(1 + (j + 2 * rank) % 3, 100 * j + rank)


def _scaler(**kw):
    # 2**40 overflows fp16 at the first step (a skipped step and a back-off), 2**12 then fits;
    # growth every 2 clean steps: the scale and its counter must survive the resume
    return LossScaler(init_scale=2.0 ** 40, backoff_factor=2.0 ** -28, growth_interval=2, **kw)


def _scheduler(opt):
    # not chainable: the lr is computed from the step count, which only the scheduler's state holds
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _make(wrapper, scenario, rank):
    seed = 0 if wrapper == "fully_shard" else rank  # the others broadcast rank 0's weights
    model = wrap(wrapper, TiedNet(seed=seed))
    if scenario == "sharded_optimizer":
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.02)
    else:
        opt = torch.optim.AdamW(_trainable(model), lr=0.02)
    sched = _scheduler(opt) if scenario == "scheduler" else None
    scaler = _scaler() if scenario == "loss_scaler" else None
    return model, opt, sched, scaler


def _train_case(wrapper, scenario, mode, path):
    """One case in this rank: mode "full" (uninterrupted), "save" (save at SAVE_AT, one more step) or
    "resume" (from path). Returns the full weights and the scale."""
    rank = dist.get_rank()
    model, opt, sched, scaler = _make(wrapper, scenario, rank)
    state = TrainState(model, opt, scaler, scheduler=sched)
    if mode == "resume":
        assert state.load(path)
    acc = GradientAccumulator(model, opt, K, max_grad_norm=0.5) if scenario == "accumulate" else None
    last = SAVE_AT + 1 if mode == "save" else STEPS
    while state.step < last:
        if acc is not None:
            for j in range(state.step * K, min((state.step + 1) * K, MICRO)):
                x, y = _micro_batch(j, rank)
                with acc.micro_step():
                    acc.backward(lm_loss(model, x, y), num_samples=len(x))
            if acc.micro_steps_in_window:
                acc.flush()  # the short last window
        else:
            _step(model, opt, scaler, *_step_batch(state.step, rank))
            if sched is not None:
                sched.step()
        state.step += 1
        if mode == "save" and state.step == SAVE_AT:
            state.save(path)
    return dict(weights=model_state_dict(model), scale=scaler.get_scale() if scaler else None)


def _step(model, opt, scaler, x, y, clip=False):
    """One optimizer step on (x, y): fp16 autocast and the loss scaler when there is one;
    ``clip``: the gradient's norm clipped to 0.5 first (what the accumulator does)."""
    opt.zero_grad()
    if scaler is not None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        lm_loss(model, x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(_trainable(model), 0.5)
        opt.step()


def _run(mode, folder, cases):
    out = {}
    for wrapper, scenario in cases:
        path = os.path.join(folder, f"{wrapper}-{scenario}.pt")
        out[(wrapper, scenario)] = _train_case(wrapper, scenario, mode, path)
    if mode == "save":  # every checkpoint written and one step more done: rank 1 dies
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    return out


def _reference(scenario):
    """One process, the full batch of every step (every rank's part), the same optimizer."""
    model = TiedNet(seed=0)
    opt = torch.optim.AdamW(_trainable(model), lr=0.02)
    sched = _scheduler(opt) if scenario == "scheduler" else None
    scaler = _scaler() if scenario == "loss_scaler" else None
    for step in range(STEPS):
        if scenario == "accumulate":
            parts = [_micro_batch(j, r) for j in range(step * K, min((step + 1) * K, MICRO)) for r in range(WORLD)]
        else:
            parts = [_step_batch(step, r) for r in range(WORLD)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        _step(model, opt, scaler, x, y, clip=scenario == "accumulate")
        if sched is not None:
            sched.step()
    return model.state_dict(), scaler.get_scale() if scaler else None


def test_every_wrapper_with_every_piece_trains_as_one_process_and_resumes_bit_for_bit(tmp_path):
    folder = str(tmp_path)
    full = launch(_run, nprocs=WORLD, args=("full", folder, CASES), timeout=300)
    with pytest.raises(LaunchError, match="SIGKILL"):
        launch(_run, nprocs=WORLD, args=("save", folder, CASES), timeout=300)
    resumed = launch(_run, nprocs=WORLD, args=("resume", folder, CASES), timeout=300)
    references = {s: _reference(s) for s in SCENARIOS}
    for case in CASES:
        ref_weights, ref_scale = references[case[1]]
        ours = full[0][case]
        # fp32: the same maths summed in another order; fp16 autocast: rounding of half-batch matmuls
        tol = dict(rtol=1e-3, atol=1e-3) if case[1] == "loss_scaler" else dict(rtol=1e-5, atol=2e-5)
        assert list(ours["weights"]) == list(ref_weights), case  # the plain model's names
        for name, w in ref_weights.items():
            torch.testing.assert_close(ours["weights"][name], w, **tol, msg=lambda m: f"{case} {name}: {m}")
        assert ours["scale"] == ref_scale, case
        for rank in range(WORLD):
            for name, w in full[rank][case]["weights"].items():
                assert torch.equal(resumed[rank][case]["weights"][name], w), f"{case} rank {rank}: {name} after resume"
                assert torch.equal(full[0][case]["weights"][name], w), f"{case}: rank {rank} differs from rank 0"
            assert resumed[rank][case]["scale"] == full[rank][case]["scale"], case


# --------------------------------------------------------------------------- DTensor models and pipeline stages
#
# A small decoder (conftest.TinyGPT) on four layouts: FSDP x TP on a 2 x 2 mesh (4 ranks), TP alone and
# FSDP alone (2 ranks), and a pipeline of two stages (2 ranks). Each trains with accumulation over uneven
# micro-batches (a short last window, flushed), clipping, an LR scheduler, in fp32 and in bf16 autocast,
# saves at step 2 (one file or a torch.distributed.checkpoint folder), takes one step more and is killed;
# it resumes on *another* layout and must end equal to one process trained on the full batch.

GPT_SEQ, DP_PARTS = 8, 2
LAYOUTS = {"fsdp_tp": (2, 2), "tp": (1, 2), "dp": (2, 1), "pp": None}      # (dp, tp); None: 2 pipeline stages
# (saved on, precision, sharded checkpoint) -> resumed on
RESUMES = {("fsdp_tp", "fp32", True): "dp", ("fsdp_tp", "bf16", False): "tp",
           ("tp", "fp32", False): "fsdp_tp", ("tp", "bf16", True): "pp",
           ("pp", "fp32", True): "fsdp_tp", ("pp", "bf16", False): "tp"}


def _world(layout):
    return 2 if LAYOUTS[layout] is None else LAYOUTS[layout][0] * LAYOUTS[layout][1]


def _gpt_batch(j, dp_rank, dp):
    """Micro-batch j: two uneven parts (1 to 3 sequences each); a layout with dp=2 gives part d to the
    ranks of data-parallel index d, one with dp=1 gives all of it to every rank."""
    parts = []
    for p in range(DP_PARTS):
        g = torch.Generator().manual_seed(100 * j + p)
        parts.append(torch.randint(0, VOCAB, (1 + (j + 2 * p) % 3, GPT_SEQ + 1), generator=g))
    t = torch.cat(parts) if dp == 1 else parts[dp_rank]
    return t[:, :-1], t[:, 1:]


def _lm_loss(logits, y, reduction="mean"):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1), reduction=reduction)


def _gpt_case(layout, precision, mode, path, sharded):
    """One (layout, precision) run in this rank: "save" (save at SAVE_AT, one step more) or "resume"."""
    from conftest import TinyGPT, parallelize_gpt
    from mgpu_lab import PipelineStage, ScheduleGPipe
    from mgpu_lab.training.state_dicts import merge_on_rank0, model_state
    rank, net = dist.get_rank(), TinyGPT(seq=GPT_SEQ, seed=0)
    if LAYOUTS[layout] is None:
        model, dp, dp_rank = net.stage(rank, 2), 1, 0
        stage = PipelineStage(model, rank, 2, device=torch.device("cpu"))   # device= by keyword: both signatures
        pipe = ScheduleGPipe(stage, 2, loss_fn=lambda out, y: _lm_loss(out, y, "sum"), scale_grads=False)
    else:
        dp, tp = LAYOUTS[layout]
        model, dp_rank, stage = parallelize_gpt(net, dp, tp), rank // tp, None
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)   # DTensors on two meshes and plain tensors: foreach copes
    sched = _scheduler(opt)
    acc = GradientAccumulator(stage or model, opt, K, max_grad_norm=0.5)
    state = TrainState(model, opt, scheduler=sched, sharded=sharded)
    if mode == "resume":
        assert state.load(path)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    last = SAVE_AT + 1 if mode == "save" else STEPS
    while state.step < last:
        for j in range(state.step * K, min((state.step + 1) * K, MICRO_GPT)):
            x, y = _gpt_batch(j, dp_rank, dp)
            with autocast:
                if stage is not None:            # the schedule runs forward and backward; count the tokens
                    pipe.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
                    acc.record(num_samples=y.numel())
                else:
                    with acc.micro_step():
                        acc.backward(_lm_loss(model(x), y), num_samples=y.numel())
        if acc.micro_steps_in_window:
            acc.flush()                          # the short last window
        sched.step()
        state.step += 1
        if mode == "save" and state.step == SAVE_AT:
            state.save(path)
    return merge_on_rank0(model_state(model))


MICRO_GPT = 10  # windows of K=3 micro-batches: [0 1 2] [3 4 5] [6 7 8] [9], the last one short and flushed


def _gpt_run(mode, folder, cases):
    out = {}
    for case in cases:
        layout, precision, sharded = case if mode == "save" else (RESUMES[case], case[1], case[2])
        path = os.path.join(folder, "-".join(map(str, case)) + ("" if sharded else ".pt"))
        out[case] = _gpt_case(layout, precision, mode, path, sharded)
    if mode == "save":
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    return out


def _gpt_reference(precision):
    from conftest import TinyGPT
    model = TinyGPT(seq=GPT_SEQ, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = _scheduler(opt)
    for step in range(STEPS):
        parts = [_gpt_batch(j, 0, 1) for j in range(step * K, min((step + 1) * K, MICRO_GPT))]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = _lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model.state_dict()


def test_dtensor_layouts_and_a_pipeline_train_as_one_process_and_resume_on_another_layout(tmp_path):
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    folder = str(tmp_path)
    for n in (4, 2):  # save on each layout of n ranks (then a rank is killed), resume on another
        cases = [c for c in RESUMES if _world(c[0]) == n]
        with pytest.raises(LaunchError, match="SIGKILL"):
            launch(_gpt_run, nprocs=n, args=("save", folder, cases), timeout=300)
    resumed = {}
    for n in (2, 4):
        cases = [c for c in RESUMES if _world(RESUMES[c]) == n]
        resumed.update(launch(_gpt_run, nprocs=n, args=("resume", folder, cases), timeout=300)[0])
    references = {p: _gpt_reference(p) for p in ("fp32", "bf16")}
    noise = sum((references["bf16"][n] - w).square().sum() for n, w in references["fp32"].items()).sqrt().item()
    for case, weights in resumed.items():
        ref, where = references[case[1]], f"saved on {case}, resumed on {RESUMES[case]}"
        assert sorted(weights) == sorted(ref), where
        if case[1] == "fp32":  # the same maths summed in another order
            for name, w in ref.items():
                torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {name}: {m}")
        else:  # bf16: each rank rounds its own part of a matmul, and Adam turns a rounding into a full step
            # where a gradient is ~0: the whole model's distance must stay within bf16's own noise (how far
            # one process in bf16 ends from one process in fp32)
            off = sum((weights[n] - w).square().sum() for n, w in ref.items()).sqrt().item()
            assert off <= 1.5 * noise, f"{where}: {off:.3e} away from one process in bf16 (bf16's noise: {noise:.3e})"


# --------------------------------------------------------------------------- docs/LIBRARY.md's loop on a mesh

def _library_mesh_loop(dp, tp, samples, path):
    """docs/LIBRARY.md's "On a mesh" loop, as it reads, except: a save every 2 steps (not 100) and fp32 (the
    autocast off, so that layouts agree to 1e-5)."""
    import re
    from torch.utils.data import TensorDataset
    from conftest import ROOT, TinyGPT, parallelize_gpt
    guide = (ROOT / "docs" / "LIBRARY.md").read_text()
    block = re.search(r"^## On a mesh\n.*?```python\n(.*?)```", guide, re.S | re.M).group(1)
    block = block.replace("state.step % 100 == 0", "state.step % 2 == 0")
    block = block.replace("torch.autocast(device.type, dtype=autocast_dtype(device))",
                          "torch.autocast(device.type, enabled=False)")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (32, GPT_SEQ + 1), generator=g)[:samples]
    scope = {"dp": dp, "tp": tp, "net": TinyGPT(seq=GPT_SEQ, seed=0), "global_batch": 8, "micro_batch": 4,
             "dataset": TensorDataset(tokens[:, :-1], tokens[:, 1:]), "loss_fn": _lm_loss,
             "lr_lambda": lambda step: 1.0 / (1 + step),
             "parallelize": lambda net, mesh: _parallelize_on(net, mesh, parallelize_gpt)}
    cwd = os.getcwd()
    os.chdir(path)  # the loop saves to "ckpt"
    try:
        exec(compile(block, "docs/LIBRARY.md", "exec"), scope)
    finally:
        os.chdir(cwd)
    from mgpu_lab.training.state_dicts import merge_on_rank0, model_state
    return scope["state"].step, merge_on_rank0(model_state(scope["model"]))


def _parallelize_on(net, mesh, parallelize_gpt):
    dp, tp = mesh.mesh.shape
    return parallelize_gpt(net, dp, tp)


def test_library_guides_mesh_loop_resumes_on_another_layout(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    for folder in (full, cut):
        folder.mkdir()
    steps, uninterrupted = launch(_library_mesh_loop, nprocs=4, args=(2, 2, 32, str(full)), timeout=300)[0]
    assert steps == 4
    launch(_library_mesh_loop, nprocs=4, args=(2, 2, 16, str(cut)), timeout=300)   # the data ends after step 2
    steps, weights = launch(_library_mesh_loop, nprocs=2, args=(1, 2, 32, str(cut)), timeout=300)[0]
    assert steps == 4  # resumed at step 2 on tp=2 alone (K doubles), the same samples skipped
    for name, w in uninterrupted.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
