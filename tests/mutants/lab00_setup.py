"""Mutants of lab 00: rank_slice (torch.chunk sizes) and global_mean (weight by rows)."""
from . import body, mutant, prepend, swap

LAB = "00_setup"


# --- rank_slice ------------------------------------------------------------------

@mutant("rank_slice", "wrong")
def floor_instead_of_ceil(solution):
    "rows // world_size rows per rank: 7 rows over 2 ranks loses the last row"
    return swap(solution, "-(-rows // world_size)", "rows // world_size")


@mutant("rank_slice", "wrong")
def remainder_to_the_last_rank(solution):
    "even split, the remainder to the last rank (numpy.array_split's other cousin)"
    return body(solution, """
        rows = batch.shape[0]
        per_rank = rows // world_size
        stop = rows if rank == world_size - 1 else (rank + 1) * per_rank
        return batch[rank * per_rank:stop]
    """)


@mutant("rank_slice", "wrong")
def a_copy_not_a_view(solution):
    "the right rows, but copied (.clone()) instead of a view"
    return swap(solution, "return batch[start:min(start + per_rank, rows)]",
                "return batch[start:min(start + per_rank, rows)].clone()")


@mutant("rank_slice", "reference")
def calls_torch_chunk(solution):
    "torch.chunk itself, the function it re-implements"
    return body(solution, """
        chunks = torch.chunk(batch, world_size)
        return chunks[rank] if rank < len(chunks) else batch[:0]
    """)


@mutant("rank_slice", "reference")
def tensor_split_through_getattr(solution):
    "the reference reached through getattr of a built name"
    return body(solution, """
        split = getattr(batch, "tensor" + "_split")
        return split(world_size)[rank]
    """)


@mutant("rank_slice", "copy")
def copies_the_checks_expected_line(solution):
    "the visible check's own lines (torch.chunk, then an empty slice past the end)"
    return body(solution, """
        chunks = batch.chunk(world_size)
        expected = chunks[rank] if rank < len(chunks) else batch[:0]
        return expected
    """)


@mutant("rank_slice", "tamper")
def patches_torch_equal(solution):
    "torch.equal patched to always agree, and zeros of the right size"
    return prepend(body(solution, """
        rows = -(-batch.shape[0] // world_size)
        return torch.zeros_like(batch[:rows])
    """), """
        torch.equal = lambda *a, **k: True
        torch.allclose = lambda *a, **k: True
    """)


# --- global_mean ------------------------------------------------------------------

@mutant("global_mean", "wrong")
def mean_of_the_ranks_means(solution):
    "averages the per-rank means: wrong when the slices are uneven (4 and 3 rows)"
    return body(solution, """
        mean = local_rows.mean(dim=0)
        dist.all_reduce(mean)
        return mean / dist.get_world_size()
    """)


@mutant("global_mean", "wrong")
def no_communication(solution):
    "each rank's own mean: no collective at all"
    return body(solution, "return local_rows.mean(dim=0)")


@mutant("global_mean", "copy")
def copies_the_all_reduce_demo(solution):
    "the section 3 demo: all-reduce of the rows' sum, never divided by the count"
    return body(solution, """
        t = local_rows.sum(dim=0)
        dist.all_reduce(t)
        return t
    """)


@mutant("global_mean", "tamper")
def redefines_launch(solution):
    "a launch() of its own that answers from the check's batch (a redefined helper)"
    return prepend(solution, """
        def launch(fn, nprocs=2, **kwargs):
            return [batch.mean(dim=0)] * nprocs
    """)


@mutant("global_mean", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed assertion"
    return prepend(body(solution, "return local_rows.mean(dim=0)"), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
