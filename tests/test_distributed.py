"""dist_env() for torchrun, legacy launch and Slurm; init_distributed; the loader helper."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from mgpu_lab import DistEnv, dist_env, distributed_loader, init_distributed, is_main_process, launch, print0
from mgpu_lab.runtime.distributed import global_rank, rank_and_world_size
from conftest import requires_gpus


def test_single_process_defaults():
    assert dist_env(environ={}, argv=[]) == DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 29500)


def test_torchrun_variables():
    environ = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
               "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert dist_env(environ=environ, argv=[]) == DistEnv(5, 1, 8, 4, 1, "10.0.0.1", 29400)


@pytest.mark.parametrize("argv", [["--local_rank=1"], ["--local-rank=1"], ["--local_rank", "1", "--lr", "3"]])
def test_legacy_local_rank_argument(argv):
    environ = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    env = dist_env(environ={k: v for k, v in environ.items() if k != "LOCAL_RANK"}, argv=argv)
    assert (env.rank, env.local_rank, env.world_size, env.master_port) == (1, 1, 2, 1234)


def test_legacy_local_rank_without_rank_uses_local_rank():
    env = dist_env(environ={"WORLD_SIZE": "2"}, argv=["--local_rank=1"])
    assert (env.rank, env.local_rank, env.world_size) == (1, 1, 2)


def test_slurm_variables():
    environ = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
               "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODELIST": "gpu[03-04]"}
    assert dist_env(environ=environ, argv=[]) == DistEnv(6, 2, 8, 4, 1, "gpu03", 29500)


def test_torchrun_wins_over_slurm():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert dist_env(environ=environ, argv=[]).rank == 1


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "outside world size"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
])
def test_bad_environment_is_explained(environ, message):
    with pytest.raises(ValueError, match=message):
        dist_env(environ=environ, argv=[])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_init_distributed_nccl_without_gpu():
    with pytest.raises(RuntimeError, match="needs CUDA GPUs"):
        init_distributed(backend="nccl")


def test_main_process_helpers_outside_a_group(capsys):
    assert is_main_process()
    print0("once")
    assert capsys.readouterr().out == "once\n"


def test_inside_launch_init_distributed_returns_this_rank_and_print0_prints_once(capfd):
    def fn():
        env = init_distributed()  # already joined by launch: returns the environment
        print0("from rank 0 only")
        return env.rank, env.world_size, is_main_process()

    assert launch(fn, nprocs=2) == [(0, 2, True), (1, 2, False)]
    assert capfd.readouterr().out == "[rank 0] from rank 0 only\n"


def test_distributed_loader_shards_and_reshuffles_per_epoch():
    def fn():
        dataset = TensorDataset(torch.arange(10))
        loader = distributed_loader(dataset, batch_size=2, shuffle=True)
        epochs = [[int(i) for (batch,) in loader.epoch(e) for i in batch] for e in range(2)]
        return epochs, len(loader)

    (r0, n0), (r1, n1) = launch(fn, nprocs=2)
    for epoch in range(2):
        assert sorted(r0[epoch] + r1[epoch]) == list(range(10))  # a partition of the data
    assert r0[0] != r0[1]  # set_epoch changed the shuffle
    assert n0 == n1 == 3


def _needs_a_group():
    """Each class and function that communicates, called outside any process group."""
    from mgpu_lab import (FSDP, BucketedDDP, ColumnParallelLinear, ExpertParallelMoE, MoE, NaiveDDP,
                          PipelineStage, RowParallelLinear, ShardedOptimizer, naive_allreduce, ring_allreduce,
                          ring_attention)
    from mgpu_lab.measure.collective_trace import collective_trace
    q = torch.ones(1, 1, 2, 2)
    return {
        "distributed_loader": lambda: distributed_loader(TensorDataset(torch.arange(4)), batch_size=2),
        "NaiveDDP": lambda: NaiveDDP(nn.Linear(2, 2)),
        "BucketedDDP": lambda: BucketedDDP(nn.Linear(2, 2)),
        "FSDP": lambda: FSDP(nn.Linear(2, 2)),
        "ShardedOptimizer": lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1),
        "ColumnParallelLinear": lambda: ColumnParallelLinear(2, 2),
        "RowParallelLinear": lambda: RowParallelLinear(2, 2),
        "ExpertParallelMoE": lambda: ExpertParallelMoE.from_moe(MoE(2, 4, 2)),
        "PipelineStage": lambda: PipelineStage(nn.Linear(2, 2), 0, 2, "cpu"),
        "ring_attention": lambda: ring_attention(q, q, q),
        "ring_allreduce": lambda: ring_allreduce(torch.ones(3)),
        "naive_allreduce": lambda: naive_allreduce(torch.ones(3)),
        "collective_trace()": lambda: collective_trace().__enter__(),
    }


@pytest.mark.parametrize("who", list(_needs_a_group()))
def test_whatever_communicates_says_to_join_a_process_group_first(who):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(RuntimeError) as info:
        _needs_a_group()[who]()
    assert str(info.value) == (f"{who} needs a process group, and torch.distributed is not initialised: run it "
                               "inside mgpu_lab.launch(fn, nprocs=N), or in a script started by torchrun or "
                               "mgpu-lab launch after mgpu_lab.init_distributed()")


def test_group_ranks_and_global_ranks():
    def fn():
        second = dist.new_group([1])  # every rank makes it; global rank 1 is its rank 0
        out = [global_rank(None, 1), global_rank(dist.group.WORLD, 1), rank_and_world_size()]
        if dist.get_rank() == 1:
            out += [global_rank(second, 0), rank_and_world_size(second)]
        return out

    assert rank_and_world_size() == (0, 1)  # a process outside any group is rank 0 of 1
    assert launch(fn, nprocs=2) == [[1, 1, (0, 2)], [1, 1, (1, 2), 1, (0, 1)]]


def test_rank_device_is_the_cpu_under_gloo_and_outside_a_group():
    from mgpu_lab import rank_device

    assert rank_device() == torch.device("cpu")
    assert launch(lambda: (dist.get_backend(), rank_device()), nprocs=2, backend="gloo") == [
        ("gloo", torch.device("cpu"))] * 2


@requires_gpus(2)
def test_rank_device_is_this_ranks_gpu_under_nccl():
    from mgpu_lab import rank_device

    assert launch(lambda: str(rank_device()), nprocs=2) == ["cuda:0", "cuda:1"]


def _sum_on_cpu_and_gpu():
    from mgpu_lab import rank_device

    cpu, gpu = torch.ones(2), torch.ones(2, device=rank_device())
    dist.all_reduce(cpu)  # gloo: NCCL alone refuses a CPU tensor
    dist.all_reduce(gpu)
    return dist.get_backend(), str(rank_device()), cpu.tolist(), gpu.cpu().tolist()


@requires_gpus(1)
def test_an_nccl_group_carries_cpu_tensors_too():
    # One rank on one GPU gets NCCL (lab 15's 1-rank check and ZeRO's single-rank test keep tensors on the CPU)
    assert launch(_sum_on_cpu_and_gpu, nprocs=1) == [("cpu:gloo,cuda:nccl", "cuda:0", [1.0, 1.0], [1.0, 1.0])]


def test_an_nccl_backend_is_given_to_torch_with_gloo_for_cpu_tensors():
    from mgpu_lab.runtime.devices import process_group_backend

    assert [process_group_backend(b) for b in ("nccl", "gloo", "mpi")] == ["cpu:gloo,cuda:nccl", "gloo", "mpi"]


def test_cleanup_exit_flushes_and_ends_the_process_at_once():
    import subprocess
    import sys
    code = ("import atexit, sys; from mgpu_lab import cleanup; atexit.register(print, 'atexit ran'); "
            "sys.stdout.write('kept'); cleanup(exit=True); print('never')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "kept")  # flushed, no atexit, nothing after
