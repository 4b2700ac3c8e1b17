"""Mutants of lab 04: byte counts, the ring all-reduce, naive and bucketed DDP, the α–β fit."""
from . import body, mutant, prepend, swap

LAB = "04_ring_allreduce_and_ddp"


# --- ex1_bytes --------------------------------------------------------------------------------

@mutant("ex1_bytes", "wrong")
def ring_without_the_all_gather(solution):
    "the ring's scatter-reduce only: (N-1)/N·S, half of what a rank sends"
    return swap(solution, "return 2 * (world_size - 1) * S / world_size", "return (world_size - 1) * S / world_size")


@mutant("ex1_bytes", "reference")
def allreduce_bytes_through_getattr(solution):
    "mgpu_lab.allreduce_bytes reached through getattr"
    return body(solution, 'return getattr(mgpu_lab, "allreduce_bytes")(numel, element_size, world_size, algorithm)')


@mutant("ex1_bytes", "copy")
def the_plot_cells_call(solution):
    "section 3's plot cell: allreduce_bytes itself"
    return body(solution, "return allreduce_bytes(numel, element_size, world_size, algorithm)")


@mutant("ex1_bytes", "tamper")
def patches_allreduce_bytes(solution):
    "mgpu_lab's allreduce_bytes replaced so that the check's reference agrees with 2S"
    return prepend(body(solution, "return 2 * S"), """
        mgpu_lab.allreduce_bytes = lambda numel, element_size, world_size, algorithm="ring": 2 * numel * element_size
    """)


# --- ex2_ring ---------------------------------------------------------------------------------

@mutant("ex2_ring", "wrong")
def scatter_reduce_one_step_short(solution):
    "an off-by-one ring step: scatter-reduce runs N-2 steps, so each chunk misses one rank's part"
    return swap(solution, "for s in range(1, world):  # scatter-reduce steps 1..N-1",
                "for s in range(1, world - 1):  # scatter-reduce steps 1..N-2")


@mutant("ex2_ring", "wrong")
def whole_tensor_around_the_ring(solution):
    "the right sum the slow way: the whole tensor passed around the ring N-1 times, the ring's bytes reported"
    return body(solution, """
        total, passing = tensor.clone(), tensor.clone()
        for s in range(1, world):
            incoming = torch.empty_like(passing)
            requests = [dist.isend(passing, right), dist.irecv(incoming, left)]
            for req in requests:
                req.wait()
            total += incoming
            passing = incoming
        tensor.copy_(total)
        sent = sum(2 * c.numel() * c.element_size() for c in chunks[1:]) if world > 1 else 0
    """)


@mutant("ex2_ring", "reference")
def calls_dist_all_reduce(solution):
    "dist.all_reduce itself, and the ring's byte count"
    return body(solution, """
        dist.all_reduce(tensor)
        sent = sum(2 * c.numel() * c.element_size() for c in chunks[1:]) if world > 1 else 0
    """)


@mutant("ex2_ring", "copy")
def the_parameter_server_demo(solution):
    "section 2's demo: naive_allreduce to a root and back"
    return body(solution, "sent = naive_allreduce(tensor, root=0).bytes_sent")


@mutant("ex2_ring", "tamper")
def redefines_run_ring(solution):
    "the check's run_ring replaced by one that all-reduces and reports no calls"
    return prepend(body(solution, "sent = 0"), """
        def run_ring(fn, tensors):
            out = []
            for t in tensors:
                x = t.clone()
                dist.all_reduce(x)
                out.append((x, 2 * (dist.get_world_size() - 1) * x.numel() * x.element_size() // dist.get_world_size(), []))
            return out
    """)


# --- ex3_naive_sync ---------------------------------------------------------------------------

@mutant("ex3_naive_sync", "wrong")
def sums_without_dividing(solution):
    "all-reduce sums: never divided by the world size"
    return swap(solution, "            p.grad /= world\n", "")


@mutant("ex3_naive_sync", "reference")
def naive_ddps_own_sync(solution):
    "mgpu_lab.NaiveDDP's synchronisation run on the model's parameters"
    return body(solution, """
        from types import SimpleNamespace
        from mgpu_lab import NaiveDDP
        params = [p for p in model.parameters() if p.requires_grad]
        NaiveDDP.finish_gradient_synchronization(SimpleNamespace(
            require_backward_grad_sync=True, _params=params, process_group=None, world_size=world))
    """)


@mutant("ex3_naive_sync", "copy")
def divides_by_four_as_section_1(solution):
    "section 1's average, total / 4: the demo's rank count, not the world size"
    return swap(solution, "p.grad /= world", "p.grad /= 4")


@mutant("ex3_naive_sync", "tamper")
def patches_allclose_and_skips_the_sync(solution):
    "torch.allclose patched to always agree, and no communication"
    return prepend(body(solution, "pass"), """
        torch.allclose = lambda *args, **kwargs: True
    """)


# --- ex4_buckets ------------------------------------------------------------------------------
# Order matters here: exercise 5 forbids BucketedDDP too, and a *statement* of an earlier cell that names it
# (make_buckets' def) counts against exercise 5 as a helper it could call. The mutants that name it stay out of
# the round where exercise 5 keeps its solution (the 4th of exercise 4's mutants is graded in that round).

@mutant("ex4_buckets", "wrong")
def forward_order(solution):
    "parameters in registration order, not the reverse order backward produces them"
    return swap(solution, "for name, p in reversed(named_parameters):", "for name, p in named_parameters:")


@mutant("ex4_buckets", "reference")
def bucketed_ddp_through_a_built_name(solution):
    "mgpu_lab.BucketedDDP, reached through getattr of a built name, on a module holding the parameters"
    return body(solution, """
        holder = nn.Module()
        for i, (name, p) in enumerate(named_parameters):
            holder.register_parameter(f"p{i}", p)
        names = {f"p{i}": name for i, (name, _) in enumerate(named_parameters)}
        lib = getattr(mgpu_lab, "Bucketed" + "DDP")(holder, bucket_cap_mb=bucket_cap_mb)
        buckets = [[names[n] for n in bucket] for bucket in lib.buckets]
    """)


@mutant("ex4_buckets", "wrong")
def a_full_bucket_at_the_cap(solution):
    "a bucket counted full when it reaches the cap exactly (>= instead of >)"
    return swap(solution, "if not buckets or size + nbytes > cap:", "if not buckets or size + nbytes >= cap:")


@mutant("ex4_buckets", "tamper")
def patches_the_buckets_property(solution):
    "BucketedDDP's buckets property replaced so that the reference agrees with one bucket of everything"
    return prepend(body(solution, "buckets = [[name for name, p in reversed(named_parameters) if p.requires_grad]]"), """
        getattr(mgpu_lab, "Bucketed" + "DDP").buckets = property(lambda self: [list(reversed(list(self._names.values())))])
    """)


@mutant("ex4_buckets", "copy")
def the_checks_bucketed_ddp_line(solution):
    "the visible judge's BucketedDDP(model, bucket_cap_mb=cap).buckets, in a one-rank launch"
    return body(solution, """
        holder = nn.Module()
        for i, (name, p) in enumerate(named_parameters):
            holder.register_parameter(f"p{i}", p)
        names = {f"p{i}": name for i, (name, _) in enumerate(named_parameters)}
        lib = launch(lambda: BucketedDDP(holder, bucket_cap_mb=bucket_cap_mb).buckets, nprocs=1)[0]
        buckets = [[names[n] for n in bucket] for bucket in lib]
    """)


# --- ex5_bucketed -----------------------------------------------------------------------------

# Exercise 3's reference mutant names NaiveDDP inside sync_gradients' def, which counts against exercise 5 too
# (it forbids NaiveDDP): exercise 5's 2nd mutant, graded in that round, is its own reference call.
FINISH = """
    for work, flat, b in self.pending:
        work.wait()
        flat /= dist.get_world_size()
        offset = 0
        for p in self.buckets[b]:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    self.pending, self.ready, self.next_bucket = [], [0] * len(self.buckets), 0
"""


@mutant("ex5_bucketed", "wrong")
def launches_everything_at_the_end_of_backward(solution):
    "buckets launched only when the last gradient of backward is ready: right numbers, no overlap"
    return body(solution, """
        self.ready[self.bucket_of[param]] += 1
        if sum(self.ready) == sum(len(bucket) for bucket in self.buckets):
            for b, bucket in enumerate(self.buckets):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                self.pending.append((dist.all_reduce(flat, async_op=True), flat, b))
            self.next_bucket = len(self.buckets)
    """)


@mutant("ex5_bucketed", "reference")
def naive_ddps_sync_after_backward(solution):
    "no hooks' work; mgpu_lab.NaiveDDP's synchronisation after backward"
    return body(body(solution, region=1, code="""
        from types import SimpleNamespace
        from mgpu_lab import NaiveDDP
        NaiveDDP.finish_gradient_synchronization(SimpleNamespace(
            require_backward_grad_sync=True, _params=list(self.bucket_of), process_group=None,
            world_size=dist.get_world_size()))
    """), "pass")


@mutant("ex5_bucketed", "wrong")
def sums_without_dividing(solution):
    "the buckets' sums copied back, never divided by the world size"
    return swap(solution, "            flat /= dist.get_world_size()\n", "")


@mutant("ex5_bucketed", "copy")
def exercise_3s_sync_after_backward(solution):
    "exercise 3's sync_gradients copied into finish_gradient_synchronization: one all-reduce per parameter, after backward"
    return body(body(solution, region=1, code="""
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
    """), "pass")


@mutant("ex5_bucketed", "tamper")
def redefines_train_replica(solution):
    "the check's train_replica replaced by one that reports a perfect timeline, after a naive sync"
    return prepend(body(body(solution, region=1, code=FINISH), "pass"), """
        def train_replica(model, steps, sync, watch=False):
            inner = model.module
            return ({k: v.cpu() for k, v in inner.state_dict().items()}, True, ["gagag|"] * steps)
    """)


# --- ex6_alpha_beta ---------------------------------------------------------------------------

@mutant("ex6_alpha_beta", "wrong")
def plain_least_squares(solution):
    "squared seconds, not relative errors: the largest size decides alone"
    return swap(solution, "w = [1 / t ** 2 for t in seconds]", "w = [1.0 for t in seconds]")


@mutant("ex6_alpha_beta", "wrong")
def ring_latency_not_scaled(solution):
    "the ring's fitted alpha kept for every N: its 2(N-1) steps not counted"
    return swap(solution, "ring = (n - 1) * a_ring + 2", "ring = a_ring + 2")


@mutant("ex6_alpha_beta", "reference")
def the_demo_cells_weighted_polyfit(solution):
    "the plot cell after the exercise: np.polyfit with weights 1/t, the reference the exercise re-implements"
    return body(solution, "beta, alpha = np.polyfit(nbytes, seconds, 1, w=1 / np.asarray(seconds))")


@mutant("ex6_alpha_beta", "copy")
def the_old_graded_cells_helpers(solution):
    "least_squares and model_crossover, which the graded cell used to define and show, called as the answers"
    solution = body(solution, "alpha, beta = least_squares(nbytes, seconds)")
    return swap(solution, """    (a_ring, b_ring), (a_ps, b_ps) = ring_fit, ps_fit
    for n in range(2, max_ranks + 1):
        ring = (n - 1) * a_ring + 2 * (n - 1) / n * nbytes * b_ring  # 2(N-1) steps of alpha/2
        ps = a_ps + (n - 1) * nbytes * b_ps                          # the root's link: (N-1)·S
        if ps > ring:
            return n
    return None""", "    return model_crossover(nbytes, ring_fit, ps_fit, max_ranks)")


@mutant("ex6_alpha_beta", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed assertion, and a plain fit"
    return prepend(swap(solution, "w = [1 / t ** 2 for t in seconds]", "w = [1.0 for t in seconds]"), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
