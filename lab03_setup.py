"""Join the job that torchrun (or Open MPI's mpirun) started, and leave it."""
import os

import torch
import torch.distributed as dist


def setup():
    """Read who this process is (torchrun's or mpirun's variables); bind the GPU; join the group.
    Returns (rank, local_rank, world_size, device)."""
    ### BEGIN SOLUTION
    if "RANK" in os.environ:  # torchrun (or the legacy launcher, or a script that exported them)
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    else:  # Open MPI's mpirun
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE")
    rank, local_rank, world_size = (int(os.environ[name]) for name in names)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # before anything touches CUDA: this process owns cuda:local_rank
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # env:// reads MASTER_ADDR and MASTER_PORT; rank and world size are passed (mpirun sets no RANK/WORLD_SIZE)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
    return rank, local_rank, world_size, device
    ### END SOLUTION


def cleanup():
    """Leave the process group (every rank, at the end)."""
    ### BEGIN SOLUTION
    dist.destroy_process_group()
    ### END SOLUTION
