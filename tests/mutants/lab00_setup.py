"""Mutants of lab 00: rank_slice (balanced, the larger slices last) and global_mean (weight by rows).

Issue 29's attacks on the "must not call" guard (a reference reached past it) are kind ``wrong``:
they must score 0 because the reference computes something else than the exercise asks, whether or
not the guard sees them, and tests/test_mutants.py counts a ``reference`` kill only when it does."""
from . import body, mutant, prepend, swap

LAB = "00_setup"


# --- rank_slice ------------------------------------------------------------------

@mutant("rank_slice", "wrong")
def larger_slices_first(solution):
    "balanced, but the extra rows on the first ranks (torch.tensor_split's order), where rank 0 has extra work"
    return body(solution, """
        base, extra = divmod(batch.shape[0], world_size)
        start = rank * base + min(rank, extra)
        return batch[start:start + base + (rank < extra)]
    """)


@mutant("rank_slice", "wrong",
        message="takes torch.tensor_split's slices from the other end (rank r gets slice N-1-r): the sizes are right, "
                "but rank 0 holds the batch's last rows; the slices must follow the rows in rank order, so only the "
                "sizes are reversed",
        section="5. Warm-up: each rank's slice of the batch",
        learner="learnA, 2026-12-05, considered: attempts/lab00/rank_slice-1.py")
def reversed_slices(solution):
    "tensor_split's slices taken from the other end: the larger ones last, but the rows in reverse rank order"
    return body(solution, """
        base, extra = divmod(batch.shape[0], world_size)
        r = world_size - 1 - rank                      # torch.tensor_split's slice, counted from the end
        start = r * base + min(r, extra)
        return batch[start:start + base + (r < extra)]
    """)


@mutant("rank_slice", "wrong")
def a_copy_not_a_view(solution):
    "the right rows, but copied (.clone()) instead of a view"
    return swap(solution, "return batch[start:start + base + (rank >= small)]",
                "return batch[start:start + base + (rank >= small)].clone()")


@mutant("rank_slice", "reference")
def calls_tensor_split(solution):
    "torch.tensor_split, the balanced split of torch: the larger slices first"
    return body(solution, "return torch.tensor_split(batch, world_size)[rank]")


@mutant("rank_slice", "wrong")
def chunk_through_the_guards_wrapped(solution):
    "issue 29 attack, the guard's __wrapped__: torch.chunk from the module's dict, unguarded; chunk's sizes are not the twist"
    return body(solution, """
        chunk = vars(torch)["chunk"]
        chunk = getattr(chunk, "__wrapped__", chunk)
        parts = chunk(batch, world_size)
        return parts[rank] if rank < len(parts) else batch[:0]
    """)


@mutant("rank_slice", "copy")
def copies_the_demos_chunk_line(solution):
    "section 5's torch.chunk, with an empty slice past the end (the lab's old check)"
    return body(solution, """
        chunks = batch.chunk(world_size)
        return chunks[rank] if rank < len(chunks) else batch[:0]
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


@mutant("global_mean", "wrong",
        message="weights each rank's mean by its rows, sum(n_i * mean_i) / sum(n_i): a rank with 0 rows has a NaN "
                "mean (0 / 0), and 0 * NaN is NaN, so every rank gets NaN; send each rank's sum of rows (0 when it "
                "has none) and its count instead",
        section="5. Warm-up: each rank's slice of the batch",
        learner="learnA, 2026-12-05, considered: attempts/lab00/global_mean-1.py")
def weights_the_ranks_means(solution):
    "the per-rank means weighted by their rows: NaN on every rank when one rank holds no rows"
    return body(solution, """
        n = torch.tensor(float(local_rows.shape[0]), dtype=local_rows.dtype, device=local_rows.device)
        weighted = local_rows.mean(dim=0) * n
        dist.all_reduce(weighted)
        dist.all_reduce(n)
        return weighted / n
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
