"""Mutants of lab 04: exact byte counts, the ring to the left step by step, naive and bucketed DDP over uneven
slices (with a small first bucket), the α–β fit over several N.

Each exercise grades a variant the library does not compute (the busiest rank's exact bytes, the left ring's
partial sums, sample-weighted averages, a first-bucket cap, a fit over N): a reference reached any way scores 0
because it computes the plain variant, whatever the guard sees. The attack mutants reach it past the guard.
"""
from . import body, mutant, prepend, swap

LAB = "04_ring_allreduce_and_ddp"


# --- ex1_bytes --------------------------------------------------------------------------------

@mutant("ex1_bytes", "wrong")
def the_formula_for_every_size(solution):
    "2(N-1)/N·S whatever the size: exact only when N divides the number of elements"
    return body(solution, """
        if algorithm == "ring":
            return 2 * (world_size - 1) * S / world_size
        if algorithm == "parameter_server":
            return (world_size - 1) * S
        raise ValueError(algorithm)
    """)


@mutant("ex1_bytes", "wrong",
        message="counts the biggest chunk, ceil(numel / N) elements, in each of the 2(N-1) steps: each rank sends "
                "every chunk but one in each phase (2S minus two chunks of its own), so the busiest rank is the one "
                "that leaves out the two smallest",
        section="3. The ring: everyone talks to a neighbour",
        learner="learnB, 2026-12-05, considered: attempts/lab04/ex1_bytes-1.py")
def biggest_chunk_every_step(solution):
    "the busiest rank taken to send the biggest chunk in each of the 2(N-1) steps"
    return body(solution, """
        if algorithm == "parameter_server":
            return (world_size - 1) * S
        if algorithm != "ring":
            raise ValueError(f"unknown algorithm {algorithm!r}")
        return 2 * (world_size - 1) * -(-numel // world_size) * element_size
    """)


@mutant("ex1_bytes", "reference")
def allreduce_bytes_through_getattr(solution):
    "mgpu_lab.allreduce_bytes reached through getattr"
    return body(solution, 'return getattr(mgpu_lab, "allreduce_bytes")(numel, element_size, world_size, algorithm)')


@mutant("ex1_bytes", "wrong")
def rank_zeros_bytes(solution):
    "the bytes of rank 0, not of the busiest rank"
    return swap(solution, "return max(sent) * element_size", "return sent[0] * element_size")


@mutant("ex1_bytes", "copy")
def the_plot_cells_call(solution):
    "section 3's plot cell: allreduce_bytes itself"
    return body(solution, "return allreduce_bytes(numel, element_size, world_size, algorithm)")


@mutant("ex1_bytes", "tamper")
def patches_allreduce_bytes(solution):
    "mgpu_lab's allreduce_bytes replaced so that a check's reference would agree with 2S"
    return prepend(body(solution, "return 2 * S"), """
        mgpu_lab.allreduce_bytes = lambda numel, element_size, world_size, algorithm="ring": 2 * numel * element_size
    """)


@mutant("ex1_bytes", "wrong")
def attack_second_copy_of_the_collectives_module(solution):
    "attack: allreduce_bytes from a second copy of mgpu_lab's collectives module, loaded from its file past the "
    "guard; it computes the formula, not the busiest rank's bytes"
    return body(solution, """
        import importlib.util
        import mgpu_lab.parallel.collectives as lib
        spec = importlib.util.spec_from_file_location("__main__", lib.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        return copy.allreduce_bytes(numel, element_size, world_size, algorithm)
    """)


# --- ex2_ring ---------------------------------------------------------------------------------

@mutant("ex2_ring", "wrong")
def section_3s_ring_to_the_right(solution):
    "section 3's ring, to the right: the right sums, but other partial sums after every step (and other bytes)"
    solution = swap(solution, "requests.append(dist.isend(send, left))", "requests.append(dist.isend(send, right))")
    solution = swap(solution, "requests.append(dist.irecv(recv, right))", "requests.append(dist.irecv(recv, left))")
    solution = swap(solution, "send, acc = chunks[(rank + s - 1) % world], chunks[(rank + s) % world]",
                    "send, acc = chunks[(rank - s + 1) % world], chunks[(rank - s) % world]")
    return swap(solution, "sent += exchange(chunks[(rank + s - 2) % world], chunks[(rank + s - 1) % world])",
                "sent += exchange(chunks[(rank - s + 2) % world], chunks[(rank - s + 1) % world])")


@mutant("ex2_ring", "wrong")
def scatter_reduce_one_step_short(solution):
    "an off-by-one ring step: scatter-reduce runs N-2 steps, so each chunk misses one rank's part"
    return swap(solution, "for s in range(1, world):  # scatter-reduce steps 1..N-1, to the left",
                "for s in range(1, world - 1):  # scatter-reduce steps 1..N-2")


@mutant("ex2_ring", "wrong")
def forwards_the_received_chunk(solution):
    "forwards the chunk it received, not the one it reduced: each step passes on one rank's part, so the partial sums miss the ranks before"
    solution = swap(solution, "        incoming = torch.empty_like(acc)\n",
                    "        if s > 1:\n            send = incoming\n        incoming = torch.empty_like(acc)\n")
    return solution


@mutant("ex2_ring", "reference")
def calls_dist_all_reduce(solution):
    "dist.all_reduce itself, the left ring's byte count, and the final tensor as every state"
    return body(solution, """
        dist.all_reduce(tensor)
        sizes = [c.numel() for c in chunks]
        sent = (2 * flat.numel() - sizes[(rank - 1) % world] - sizes[(rank - 2) % world]) * flat.element_size()
        states = [flat.clone() for _ in range(2 * (world - 1))]
    """)


@mutant("ex2_ring", "copy")
def the_parameter_server_demo(solution):
    "section 2's demo: naive_allreduce to a root and back"
    return body(solution, """
        sent = naive_allreduce(tensor, root=0).bytes_sent
        states = [flat.clone() for _ in range(2 * (world - 1))]
    """)


@mutant("ex2_ring", "tamper")
def patches_the_comparisons(solution):
    "torch.allclose and torch.equal patched to always agree, and section 3's chunk order"
    solution = swap(solution, "send, acc = chunks[(rank + s - 1) % world], chunks[(rank + s) % world]",
                    "send, acc = chunks[(rank - s + 1) % world], chunks[(rank - s) % world]")
    return prepend(solution, """
        torch.allclose = torch.equal = lambda *args, **kwargs: True
    """)


@mutant("ex2_ring", "reference")
def attack_unguarded_all_gather_and_replay(solution):
    "attack (the red team's): all-gather through the guard's __wrapped__, then section 3's simulation replayed "
    "for a plausible history: the right sum, the partial sums of the ring to the right"
    return body(solution, """
        parts = [torch.empty_like(flat) for _ in range(world)]
        gather = dist.all_gather
        while hasattr(gather, "__wrapped__"):
            gather = gather.__wrapped__
        gather(parts, flat)
        replay = simulate_ring_allreduce(parts)
        states = [torch.cat(s.chunks[rank]) for s in replay[1:]]
        flat.copy_(states[-1])
        sizes = [c.numel() for c in chunks]
        sent = (2 * flat.numel() - sizes[(rank - 1) % world] - sizes[(rank - 2) % world]) * flat.element_size()
    """)


# --- ex3_naive_sync ---------------------------------------------------------------------------
# Exercise 3's 2nd mutant names NaiveDDP inside sync_gradients' def, which counts against exercise 5 too (it
# forbids NaiveDDP): it is graded in round 1, where exercise 5 runs its own 2nd mutant, a reference call too.
# Exercise 3's 4th mutant is graded in the round where exercise 5 keeps its solution: it names no DDP.

@mutant("ex3_naive_sync", "wrong")
def averages_the_ranks(solution):
    "the average of the ranks' gradients (the three rules): a mean of means when the slices differ"
    return body(solution, """
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
    """)


@mutant("ex3_naive_sync", "reference")
def naive_ddps_own_sync(solution):
    "mgpu_lab.NaiveDDP's synchronisation run on the model's parameters: it averages"
    return body(solution, """
        from types import SimpleNamespace
        from mgpu_lab import NaiveDDP
        params = [p for p in model.parameters() if p.requires_grad]
        NaiveDDP.finish_gradient_synchronization(SimpleNamespace(
            require_backward_grad_sync=True, _params=params, process_group=None, world_size=world))
    """)


@mutant("ex3_naive_sync", "wrong")
def assumes_the_count_is_everywhere_the_same(solution):
    "weighted by this rank's count, divided by world size times it: as if every rank had as many samples"
    return swap(solution, "            p.grad /= total.item()", "            p.grad /= world * num_samples")


@mutant("ex3_naive_sync", "wrong",
        message="each gradient weighted by this rank's samples, summed, then divided by the world size: N in "
                "'divide by N after' is the samples of all ranks (one all-reduce of the count), not the ranks",
        section="5. Data parallelism by hand: NaiveDDP",
        learner="learnG, 2026-12-05, considered: attempts/lab04/ex3_naive_sync-1.py")
def weighted_sum_divided_by_the_ranks(solution):
    "each rank's gradient weighted by its count and summed, then divided by the world size, not by the total count"
    return swap(solution, "            p.grad /= total.item()", "            p.grad /= world")


@mutant("ex3_naive_sync", "copy")
def divides_by_four_as_section_1(solution):
    "section 1's average, total / 4: the demo's rank count, not the samples"
    return body(solution, """
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= 4
    """)


@mutant("ex3_naive_sync", "tamper")
def patches_allclose_and_skips_the_sync(solution):
    "torch.allclose patched to always agree, and no communication"
    return prepend(body(solution, "pass"), """
        torch.allclose = lambda *args, **kwargs: True
    """)


@mutant("ex3_naive_sync", "wrong")
def attack_second_copy_of_the_ring(solution):
    "attack: ring_allreduce(op='avg') from a second copy of mgpu_lab's collectives module, loaded from its file "
    "past the guard; it averages the ranks, a mean of means"
    return body(solution, """
        import importlib.util
        import mgpu_lab.parallel.collectives as lib
        spec = importlib.util.spec_from_file_location("__main__", lib.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        for p in model.parameters():
            if p.grad is not None:
                copy.ring_allreduce(p.grad, op="avg")
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
    "mgpu_lab.BucketedDDP, reached through getattr of a built name: one cap for every bucket"
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
    "a bucket counted full when it reaches the cap exactly (>= instead of >), as torch's C++ packing closes it"
    return swap(solution, "if not buckets or size + nbytes > (first_cap if len(buckets) == 1 else cap):",
                "if not buckets or size + nbytes >= (first_cap if len(buckets) == 1 else cap):")


@mutant("ex4_buckets", "wrong",
        message="adds each parameter, then closes the bucket once it has reached its cap (torch's C++ packing): a "
                "bucket then overshoots its cap; here a new bucket starts before a parameter that would make the "
                "current one exceed its cap",
        section="6. Buckets and overlap: BucketedDDP",
        learner="learnB, 2026-12-05, considered: attempts/lab04/ex4_buckets-1.py")
def closes_a_bucket_after_it_reaches_the_cap(solution):
    "each parameter added first, the bucket closed once its size has reached the cap: buckets overshoot"
    return body(solution, """
        current, size = [], 0
        for name, p in reversed(named_parameters):
            if not p.requires_grad:
                continue
            current.append(name)
            size += p.numel() * p.element_size()
            if size >= (first_cap if not buckets else cap):
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
    """)


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


@mutant("ex4_buckets", "wrong")
def one_cap_for_every_bucket(solution):
    "the first bucket packed to bucket_cap_mb like the others: its own cap ignored"
    return swap(solution, "(first_cap if len(buckets) == 1 else cap)", "cap")


# --- ex5_bucketed -----------------------------------------------------------------------------

FINISH = """
    for work, flat, b in self.pending:
        work.wait()
        flat /= total
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
                flat = torch.cat([p.grad.reshape(-1) for p in bucket]) * self.num_samples
                self.pending.append((dist.all_reduce(flat, async_op=True), flat, b))
            self.next_bucket = len(self.buckets)
    """)


@mutant("ex5_bucketed", "reference")
def naive_ddps_sync_after_backward(solution):
    "no hooks' work; mgpu_lab.NaiveDDP's synchronisation after backward: an average"
    return body(body(solution, region=1, code="""
        from types import SimpleNamespace
        from mgpu_lab import NaiveDDP
        NaiveDDP.finish_gradient_synchronization(SimpleNamespace(
            require_backward_grad_sync=True, _params=list(self.bucket_of), process_group=None,
            world_size=dist.get_world_size()))
    """), "pass")


@mutant("ex5_bucketed", "wrong")
def averages_the_buckets(solution):
    "the buckets' sums divided by the world size, each rank's gradient unweighted: a mean of means"
    solution = swap(solution, "for p in self.buckets[self.next_bucket]]) * self.num_samples",
                    "for p in self.buckets[self.next_bucket]])")
    return swap(solution, "            flat /= total\n", "            flat /= dist.get_world_size()\n")


@mutant("ex5_bucketed", "wrong",
        message="the buckets weighted by each rank's samples, then divided by the world size (section 6's average): "
                "a weighted sum is divided by N, the samples of all ranks, as in exercise 3",
        section="6. Buckets and overlap: BucketedDDP",
        learner="learnG, 2026-12-05, considered: attempts/lab04/ex5_bucketed-1.py")
def weighted_buckets_divided_by_the_ranks(solution):
    "the buckets weighted by num_samples, then divided by the world size instead of the total count"
    return swap(solution, "            flat /= total\n", "            flat /= dist.get_world_size()\n")


@mutant("ex5_bucketed", "copy")
def exercise_3s_sync_after_backward(solution):
    "section 5's one all-reduce per parameter copied into finish_gradient_synchronization, after backward, averaged"
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
        def train_replica(model, steps, sync, sizes=None, watch=False):
            inner = model.module
            return ({k: v.cpu() for k, v in inner.state_dict().items()}, True, ["gagag|"] * steps)
    """)


@mutant("ex5_bucketed", "wrong")
def attack_blinds_the_observer_and_averages(solution):
    "attack: the check's C10dLog rebound to one that records nothing, and BucketedDDP's plain average of the "
    "ranks: killed by the uneven slices' weights, not by the log"
    solution = swap(solution, "for p in self.buckets[self.next_bucket]]) * self.num_samples",
                    "for p in self.buckets[self.next_bucket]])")
    solution = swap(solution, "            flat /= total\n", "            flat /= dist.get_world_size()\n")
    return prepend(solution, """
        class C10dLog(TorchDispatchMode):
            def __init__(self, calls):
                super().__init__()
                self.calls = calls

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
    """)


# --- ex6_alpha_beta ---------------------------------------------------------------------------

@mutant("ex6_alpha_beta", "wrong")
def plain_least_squares(solution):
    "squared seconds, not relative errors: the largest size decides alone"
    return body(solution, """
        A = np.array([[n - 1, 2 * (n - 1) / n * s] for s, n in zip(nbytes, ranks)], dtype=np.float64)
        scale = np.abs(A).max(axis=0)
        alpha, beta = np.linalg.lstsq(A / scale, np.asarray(seconds), rcond=None)[0] / scale
    """)


@mutant("ex6_alpha_beta", "wrong")
def ring_latency_not_scaled(solution):
    "the ring's fitted alpha kept for every N: its 2(N-1) steps not counted"
    return swap(solution, "ring = (n - 1) * a_ring + 2", "ring = a_ring + 2")


@mutant("ex6_alpha_beta", "wrong",
        message="scales each row of the least-squares problem by 1/t**2: the weight 1/t**2 belongs on the squared "
                "residual, so each row (and its target) is divided by t once, as np.polyfit's w=1/t; 1/t**2 per row "
                "over-weights the fastest measurements",
        section="9. When the measurements disagree with the story: the α–β model",
        learner="learnB, 2026-12-05, considered: attempts/lab04/ex6_alpha_beta-1.py")
def rows_weighted_by_one_over_t_squared(solution):
    "relative least squares set up with rows multiplied by 1/t**2 instead of 1/t"
    return body(solution, """
        S, N, t = (np.asarray(v, dtype=np.float64) for v in (nbytes, ranks, seconds))
        w = 1 / t**2
        A = np.stack([(N - 1) * w, 2 * (N - 1) / N * S * w], axis=1)
        alpha, beta = np.linalg.lstsq(A, t * w, rcond=None)[0]
    """)


@mutant("ex6_alpha_beta", "reference")
def the_demo_cells_weighted_polyfit(solution):
    "the plot cell after the exercise: np.polyfit with weights 1/t, a line in S whatever N"
    return body(solution, "beta, alpha = np.polyfit(nbytes, seconds, 1, w=1 / np.asarray(seconds))")


@mutant("ex6_alpha_beta", "copy")
def one_line_through_every_n(solution):
    "the demo cell's fit by another numpy function (not the one forbidden): a line in S, N ignored"
    return body(solution, """
        alpha, beta = np.polynomial.polynomial.polyfit(nbytes, seconds, 1, w=1 / np.asarray(seconds))
    """)


@mutant("ex6_alpha_beta", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed assertion, and a fit that ignores N"
    return prepend(body(solution, """
        alpha, beta = np.polynomial.polynomial.polyfit(nbytes, seconds, 1, w=1 / np.asarray(seconds))
    """), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


@mutant("ex6_alpha_beta", "wrong")
def attack_polyfit_in_a_child_python(solution):
    "attack: np.polyfit computed by a child Python (subprocess), out of the guard's sight; a line in S whatever N"
    return body(solution, """
        import json, subprocess, sys
        code = ("import json, sys, numpy as np; s, t = json.loads(sys.argv[1]); "
                "print(json.dumps(list(np.polyfit(s, t, 1, w=1 / np.asarray(t)))))")
        done = subprocess.run([sys.executable, "-c", code, json.dumps([list(nbytes), list(seconds)])],
                              capture_output=True, text=True, check=True)
        beta, alpha = json.loads(done.stdout)
    """)


@mutant("ex2_ring", "copy")
def states_copied_from_the_checks_helper(solution):
    "no ring: every rank sends its whole tensor to every other, then reads the states off the check's left_ring_state"
    return body(solution, """
        mine = flat.clone()
        xs, reqs = [None] * world, []
        for r in range(world):
            if r == rank:
                xs[r] = mine
            else:
                xs[r] = torch.empty_like(flat)
                reqs += [dist.isend(mine, r), dist.irecv(xs[r], r)]
        for q in reqs:
            q.wait()
        states = [left_ring_state(xs, rank, i).to(flat.dtype) for i in range(2 * (world - 1))]
        flat.copy_(states[-1])
        sizes = [c.numel() for c in chunks]
        sent = (2 * flat.numel() - sizes[(rank - 1) % world] - sizes[(rank - 2) % world]) * flat.element_size()
        return sent, states
    """)
