"""How work is split across devices: DataParallel, the balanced criterion,
collectives, your own DDP, sharding, tensor parallelism, pipeline parallelism,
context parallelism (ring attention) and expert parallelism (mixture of experts)."""
