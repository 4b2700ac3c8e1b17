"""Helpers shared by the test files: paths, tolerances, the GPU skip, small models.

Import them by name (``from conftest import TiedNet, requires_gpus``): pytest puts
this folder on ``sys.path``. tests/data holds fixture notebooks for the grader and
the tour; they are inputs, not notebooks to validate, so nbval must not collect them.
"""
import dataclasses
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
# DDP, FSDP and DTensor import torch's compiler stack (torch._dynamo) on first use: about a second of CPU
# in each process. Imported once here, in each test process: every rank that launch() forks inherits it.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch import nn

collect_ignore = ["data"]

ROOT = Path(__file__).resolve().parents[1]

# fp32 equivalence with a reference: the same maths in another order.
RTOL, ATOL = 1e-5, 1e-6


def requires_gpus(n: int = 1):
    """Mark a test that needs ``n`` CUDA GPUs: marked ``gpu`` and skipped without them."""
    def mark(test):
        skip = pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPU(s)")
        return pytest.mark.gpu(skip(test))
    return mark


def virtual_devices(n: int):
    """``n`` virtual devices on the CPU, also on a machine with GPUs: the unit tests of DataParallel
    and of the balanced criterion check numbers, not GPUs (``devices(n)`` raises where 0 < GPUs < n;
    the tests marked ``gpu`` use real ones)."""
    return [torch.device("cpu")] * n


def mlp(seed: int = 0) -> nn.Module:
    """A 6 -> 16 -> 4 MLP, the same weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


VOCAB, DIM = 32, 16


class TiedNet(nn.Module):
    """The awkward cases of data parallelism in one model: tied weights (the head
    shares the embedding), a frozen layer, a bias without grad and a buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight
        self.head.bias.requires_grad_(False)
        self.register_buffer("scale", torch.rand(DIM) + 0.5)

    def forward(self, idx):
        h = torch.tanh(self.hidden(self.embed(idx))) * self.scale
        return self.head(torch.tanh(self.frozen(h)))


def token_batches(steps: int, batch: int = 12, seq: int = 5, seed: int = 1234):
    """``steps`` pairs (input ids, target ids) of random tokens, ``[batch, seq]`` each; the same in
    every process."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g),
             torch.randint(0, VOCAB, (batch, seq), generator=g)) for _ in range(steps)]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(x)``'s logits over VOCAB against ``y`` (in fp32 whatever the model's dtype)."""
    return nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def backward_on_this_gpu(wrap, batch: int = 12, seq: int = 5):
    """On this rank's GPU, one backward of ``wrap(TiedNet(seed=rank))`` on this rank's share of a
    batch, and of a plain ``TiedNet(seed=0)`` on all of it. Returns both, to compare gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    x, y = (t.to(device) for t in token_batches(1, batch, seq)[0])
    lo, hi = rank * batch // world, (rank + 1) * batch // world
    ref = TiedNet(seed=0).to(device)
    lm_loss(ref, x, y).backward()
    model = wrap(TiedNet(seed=rank).to(device))
    lm_loss(model, x[lo:hi], y[lo:hi]).backward()
    return model, ref


class _Attention(nn.Module):
    """Causal self-attention as LLaMA writes it: the number of heads comes from the weights'
    shape (``view(b, s, -1, head_dim)``), so ``ColwiseParallel`` on wq/wk/wv splits the heads;
    the two matmuls written out (nanoGPT's "manual implementation")."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5    # written out: FlopCounterMode counts it
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        o = scores.softmax(-1) @ v
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A decoder small enough for CPU tests: token and position embeddings, ``layers`` pre-norm
    blocks in a ModuleDict (so that a pipeline stage, the model with the other stages' blocks
    removed, keeps the full model's names, as torchtitan builds stages), a final norm and an
    untied head. ``stage(i, n)``: stage i of n."""

    TP_PLAN = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
               "mlp.0": "colwise", "mlp.2": "rowwise"}

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = 2, layers: int = 2, seq: int = 8,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleDict({str(i): _Block(dim, heads) for i in range(layers)})
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))

    def stage(self, index: int, num_stages: int) -> "TinyGPT":
        """This model with only stage ``index``'s blocks (and the embeddings first, the head last)."""
        import copy
        part = copy.deepcopy(self)
        names = list(part.blocks)
        per = -(-len(names) // num_stages)
        for name in names[:index * per] + names[(index + 1) * per:]:
            del part.blocks[name]
        if index > 0:
            part.embed = part.pos = None
        if index < num_stages - 1:
            part.norm = part.head = None
        return part


def parallelize_gpt(model: TinyGPT, dp: int = 1, tp: int = 1) -> TinyGPT:
    """``model`` on a (dp, tp) mesh of every rank: each block's TP plan on "tp", then
    ``fully_shard`` of each block and of the root on "dp" (inside launch())."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if dp > 1 and tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    else:
        mesh = init_device_mesh("cpu", (dp * tp,))
        dp_mesh, tp_mesh = (mesh, None) if dp > 1 else (None, mesh)
    for block in model.blocks.values():
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, {k: styles[v]() for k, v in TinyGPT.TP_PLAN.items()})
        if dp_mesh is not None:
            fully_shard(block, mesh=dp_mesh)
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh)
    return model


@dataclasses.dataclass
class ModelOutput:
    """A model's structured output, registered with torch.utils._pytree (as Hugging Face's
    ModelOutput is): code that walks tensor trees with pytree finds its tensors."""

    logits: torch.Tensor
    note: str = ""


torch.utils._pytree.register_dataclass(ModelOutput, field_names=["logits"], drop_field_names=["note"])


WRAPPERS = ("torch_ddp", "naive", "bucketed", "fsdp", "fully_shard")


def wrap(kind: str, module: nn.Module) -> nn.Module:
    """``module`` under one of the data-parallel wrappers a practitioner picks (inside launch()).

    fully_shard is applied as one applies it to a model's blocks: to each direct child that
    shares no parameter with another child (a tied embedding/head stays in the root), then
    to the root. Unlike the others it does not broadcast rank 0's weights: build the module
    from the same seed on every rank.
    """
    from torch.nn.parallel import DistributedDataParallel
    from mgpu_lab import FSDP, BucketedDDP, NaiveDDP
    if kind == "fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import torch.distributed as dist
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        owners = {}
        for c in children:
            for p in c.parameters():
                owners.setdefault(id(p), set()).add(id(c))
        for c in children:
            if all(len(owners[id(p)]) == 1 for p in c.parameters()):
                fully_shard(c, mesh=mesh)
        return fully_shard(module, mesh=mesh)
    makers = {"torch_ddp": DistributedDataParallel, "naive": NaiveDDP, "bucketed": BucketedDDP,
              "bucketed_small": lambda m: BucketedDDP(m, bucket_cap_mb=1e-3), "fsdp": FSDP}
    return makers[kind](module)


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two models' state (parameters and buffers)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), f"different state keys: {sorted(sa.keys() ^ sb.keys())}"
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def error_text(call, errors=Exception):
    """The message of what ``call()`` raised (an instance of ``errors``), or None when it returned.

    For checks inside launched ranks: an exception there ends the launch before a
    ``pytest.raises`` could see it, so the rank returns the text for the test to assert on."""
    try:
        call()
    except errors as e:
        return str(e)
    return None


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` running (not gone, not a zombie)? Linux /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


# multiprocessing's own service processes: one per test process, shared by every launch
# that uses spawn or a forkserver, and ended with it. Not left-behind ranks.
SERVICE_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def assert_no_children(grace: float = 10.0) -> None:
    """Nothing this test process started is still running (forked ranks, torchrun and its
    workers), multiprocessing's own service processes aside."""
    def children():
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd, parent = " ".join(p.cmdline()), p.ppid()
            except psutil.NoSuchProcess:
                continue
            service = parent == os.getpid() and any(s in cmd for s in SERVICE_PROCESSES)
            if not service:  # a rank forked by the forkserver has its command line, not its parent
                found.append(cmd)
        return found

    deadline = time.monotonic() + grace
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = children()
    assert not left, f"processes left behind: {left}"


def start_session(cmd, env=None) -> subprocess.Popen:
    """Start ``cmd`` in the repository root, in its own session, its output captured as text."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finish_session(proc: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    """Wait for ``proc``; past ``timeout`` kill its whole session (torchrun's workers too, which
    a plain ``subprocess.run`` timeout would leave behind) and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_session(cmd, env, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end in its own session (see ``finish_session``)."""
    return finish_session(start_session(cmd, env), timeout)


def pytest_configure(config):
    """Under pytest-xdist (``./run.sh test`` runs two workers), the controller prepares the
    one mutation run its workers share (tests/test_mutants.py)."""
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        from test_mutants import share_with_workers
        share_with_workers(config)


SUMMARY = "mutation run"    # test_mutants' kill-rate table, a property of its test's report
_SUMMARIES = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _SUMMARIES.extend(value for name, value in report.user_properties if name == SUMMARY)


def pytest_terminal_summary(terminalreporter):
    """The mutation run's kill-rate table, once its test has run (here or on a worker)."""
    for text in _SUMMARIES:
        terminalreporter.write_sep("=", SUMMARY)
        terminalreporter.write_line(text)


@pytest.hookimpl(trylast=True)      # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    """The mutation run (tests/test_mutants.py) starts now, in a child process that grades
    beside the other tests; its tests move to the end of the session."""
    import sys
    for item in items:
        # nbval waits 5 s for a cell's output messages after the cell has run, then fails it ("Timeout
        # of 5 seconds exceeded waiting for output": seen once on a loaded machine); the cell's own
        # limit is --nbval-cell-timeout
        if type(item).__module__.startswith("nbval") and hasattr(item, "output_timeout"):
            item.output_timeout = 60
    mutants = sys.modules.get("test_mutants")
    if mutants is not None:
        mutants.start_beside(config, items)


def exercise_cell(grade_id: str, body: str):
    """A toy lab's exercise cell (nbgrader's solution metadata), for the grader's tests."""
    from nbformat.v4 import new_code_cell
    return new_code_cell(body, metadata={"nbgrader": {"grade_id": grade_id, "solution": True,
                                                      "grade": False, "points": 0}})


def check_cell(grade_id: str, source: str, points: int = 1):
    """A toy lab's graded cell (inputs, ``### PROBE``, ``### JUDGE``), for the grader's tests."""
    from nbformat.v4 import new_code_cell
    return new_code_cell(source, metadata={"nbgrader": {"grade_id": grade_id, "grade": True,
                                                        "solution": False, "points": points}})
