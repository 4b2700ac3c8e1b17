# origin: considered alternative
# what I believed: Setting the generator argument back to its pre-forward state before the recompute is enough: the recompute draws the same numbers forward drew, so it leaves the generator where forward left it, i.e. where a plain run leaves it; no need to save and restore its state around the recompute (fork_rng does it for the default generator anyway).
# visible check said: ex2 passed
# grader said: 5/5 (full marks)
# misconception: The recompute leaves the generator where THIS call's forward left it, not where the whole forward left it: with two checkpointed calls drawing from one generator (Megatron's tracker), backward recomputes the second call and then the first, and the generator ends after the first call's draws; its state must be saved before the recompute and restored after it (checked by hand: two checkpointed dropout_from calls sharing a generator, torch.rand(3, generator=gen) after backward differs from a plain run).
def my_checkpoint(fn, *args):
    if not torch.is_grad_enabled():
        return fn(*args)
    gens = [a for a in args if isinstance(a, torch.Generator)]
    devices = sorted({a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
    gen_states = [g.get_state() for g in gens]
    recomputed = []

    def recompute():
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_state)
            for d, st in zip(devices, cuda_states):
                torch.cuda.set_rng_state(st, d)
            for g, st in zip(gens, gen_states):
                g.set_state(st)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: recomputed.append(t.detach()) or len(recomputed) - 1, lambda i: recomputed[i]):
                fn(*inputs)

    def pack(t):
        pack.count += 1
        return pack.count - 1
    pack.count = 0

    def unpack(i):
        if not recomputed:
            recompute()
        return recomputed[i]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args)
