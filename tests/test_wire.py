"""The wire meter (mgpu_lab.measure.wire) reads the bytes gloo's sockets carried: a send
of known size, and ring all-reduces against (N-1)/N of the tensor twice, within the framing
it measures; the rendezvous store's traffic is not counted."""
import sys

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.measure.wire import WireMeter, framing_per_message
from mgpu_lab.parallel.collectives import ring_allreduce

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO is Linux's")
MIB = 2**20


def _send_and_store():
    rank = dist.get_rank()
    buf = torch.zeros(MIB, dtype=torch.uint8)
    dist.barrier()
    with WireMeter() as sent:
        dist.send(buf, dst=1) if rank == 0 else dist.recv(buf, src=0)
    dist.barrier()
    with WireMeter() as stored:
        dist.distributed_c10d._get_default_store().set(f"big{rank}", b"x" * MIB)
    dist.barrier()
    return sent.sent, sent.received, stored.sent, framing_per_message()


def test_a_send_is_counted_with_its_framing_and_the_store_is_not():
    (s0, r0, store0, framing), (s1, r1, store1, _) = launch(_send_and_store, nprocs=2, timeout=60)
    assert 0 < framing < 256, framing
    assert MIB <= s0 <= MIB + 4 * framing and MIB <= r1 <= MIB + 4 * framing, (s0, r1, framing)
    assert s1 < 4 * framing and r0 < 4 * framing          # the other way: acknowledgements only
    assert store0 < 1024 and store1 < 1024                 # a MiB through the store: not counted


def _ring(n_elements):
    n = dist.get_world_size()
    t = torch.ones(n_elements)
    dist.barrier()
    with WireMeter() as wire:
        ring_allreduce(t)
    dist.barrier()
    return wire.sent, wire.received, 2 * (n - 1) * t.numel() * t.element_size() // n


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_tensor_measured(nprocs):
    for rank, (sent, received, formula) in enumerate(launch(_ring, nprocs=nprocs, args=(2**16,), timeout=60)):
        assert formula <= sent <= formula * 1.01, f"rank {rank}: sent {sent}, the formula {formula}"
        assert formula <= received <= formula * 1.01, f"rank {rank}: received {received}, the formula {formula}"


def _gloo_collectives(n_elements):
    n, out = dist.get_world_size(), {}
    x = torch.ones(n_elements * n)
    for name, fn in (("all_reduce", lambda: dist.all_reduce(x.clone())),
                     ("reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.empty(n_elements), x)),
                     ("all_gather", lambda: dist.all_gather_into_tensor(torch.empty(n_elements * n),
                                                                        torch.ones(n_elements)))):
        dist.barrier()
        with WireMeter() as wire:
            fn()
        out[name] = wire.sent
    return out, x.numel() * x.element_size()


@pytest.mark.parametrize("nprocs", [2, 4])
def test_gloos_reduce_scatter_sends_what_its_all_reduce_sends(nprocs):
    """Measured, not assumed: gloo (torch 2.13) has no ring reduce-scatter; its reduce_scatter_tensor
    sends what an all-reduce of the whole input sends, 2(N-1)/N of it, not the ring's (N-1)/N; its
    all-gather sends (N-1)/N of the output. Labs 10 and 13 count FSDP's traffic on gloo with this."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    for rank, (sent, size) in enumerate(launch(_gloo_collectives, nprocs=nprocs, args=(2**16,), timeout=60)):
        ring = 2 * (nprocs - 1) * size // nprocs
        assert ring <= sent["all_reduce"] <= ring * 1.01, (rank, sent)
        assert ring <= sent["reduce_scatter"] <= ring * 1.01, (rank, sent)
        assert ring // 2 <= sent["all_gather"] <= ring // 2 * 1.01, (rank, sent)
