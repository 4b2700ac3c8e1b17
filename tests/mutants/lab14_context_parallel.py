"""Mutants of lab 14: online_attention, window_ring_attention (forward and backward) and choose_layout (design)."""
from . import body, mutant, prepend, swap

LAB = "14_context_parallel"


# --- online_attention ---------------------------------------------------------------

@mutant("online_attention", "wrong")
def sum_not_rebased(solution):
    "the running sum kept without re-basing when the max moves: old terms counted at the old reference"
    return swap(solution, "l = l * rebase + p.sum(-1)", "l = l + p.sum(-1)")


@mutant("online_attention", "wrong",
        message="m kept as the max of the raw q·k, the 1/√d applied inside the exponentials: the output is right, but "
                "m + log(l) is then not the row's log-sum-exp, the number ring attention merges partial results with",
        section="2. The online softmax",
        learner="learnF, 2026-12-05, considered: attempts/lab14/online_attention-1.py")
def running_max_of_unscaled_scores(solution):
    "m kept as the max of the raw q·k (FlashAttention-2's bookkeeping), not of the scores q kᵀ/√d: m + log l is no log-sum-exp"
    # learnF's attempt (k and v whole, cut by block_size) on the exercise's streaming signature
    return body(solution, """
        Lq = q.shape[0]
        m = torch.full((Lq,), float("-inf"))     # running max of the raw q.k (FlashAttention-2 keeps it unscaled)
        l = torch.zeros(Lq)
        acc = 0
        history = []
        for kb, vb in blocks:
            s = q @ kb.T
            m_new = torch.maximum(m, s.max(-1).values)
            p = torch.exp((s - m_new[:, None]) * scale)
            correction = torch.exp((m - m_new) * scale)
            l = l * correction + p.sum(-1)
            acc = acc * correction[:, None] + p @ vb
            m = m_new
            history.append((m, l))
        return acc / l[:, None], history
    """)


@mutant("online_attention", "wrong",
        message="the running m and l updated in place (mul_, add_, copy_) and appended to the history: every entry "
                "is then the same tensor, the state after the last block; the state stays bounded with a new (m, l) "
                "per block, and the history keeps each block's",
        section="Exercise 1 (3 points): attention over keys that arrive in blocks",
        learner="learn14, 2026-12-05, considered: attempts/lab14/online_attention-2.py")
def state_updated_in_place(solution):
    "m, l and the weighted sum updated in place: every history entry aliases the final state"
    # learn14's attempt, verbatim
    return body(solution, """
        m = torch.full((q.shape[0],), float("-inf"))
        l = torch.zeros(q.shape[0])
        acc = None
        history = []
        for kb, vb in blocks:
            s = q @ kb.T * scale
            m_new = torch.maximum(m, s.max(-1).values)
            p = torch.exp(s - m_new[:, None])
            corr = torch.exp(m - m_new)
            # in place, so that the state never reallocates while the keys stream by
            l.mul_(corr).add_(p.sum(-1))
            if acc is None:
                acc = p @ vb
            else:
                acc.mul_(corr[:, None]).add_(p @ vb)
            m.copy_(m_new)
            history.append((m, l))
        return acc / l[:, None], history
    """)


# The history is the state the online algorithm keeps; the reference gives the output and the final log-sum-exp,
# not the running max and sum (and it needs the keys whole: the blocks concatenated, which the state check sees).
@mutant("online_attention", "reference")
def calls_sdpa(solution):
    "F.scaled_dot_product_attention on the concatenated blocks; the history from the log-sum-exp of each prefix (l = 1)"
    return body(solution, """
        ks, vs = zip(*blocks)
        k, v = torch.cat(ks), torch.cat(vs)
        s = q @ k.T * scale
        ends = torch.tensor([len(b) for b in ks]).cumsum(0).tolist()
        history = [(torch.logsumexp(s[:, :end], -1), torch.ones(q.shape[0])) for end in ends]
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0], history
    """)


# Issue 47's shortcut: every value right, the blocks concatenated, one softmax in one piece and each prefix's
# (m, l) from its definition. Only the state check rejects it: the blocks kept, and the scores grow with the keys.
@mutant("online_attention", "copy")
def concatenates_and_recomputes_prefixes(solution):
    "the blocks concatenated, section 2's softmax in one piece, each prefix's (m, l) recomputed from its definition"
    return body(solution, """
        ks, vs = zip(*blocks)
        k, v = torch.cat(ks), torch.cat(vs)
        s = q @ k.T * scale
        history, end = [], 0
        for kb in ks:
            end += kb.shape[0]
            m = s[:, :end].max(-1).values
            history.append((m, torch.exp(s[:, :end] - m[:, None]).sum(-1)))
        return torch.softmax(s, -1) @ v, history
    """)


@mutant("online_attention", "copy")
def one_piece_softmax_grown_block_by_block(solution):
    "the keys and values grown by torch.cat as the blocks arrive (each block let go), one softmax at the end"
    return body(solution, """
        k = v = None
        history = []
        for kb, vb in blocks:
            k = kb if k is None else torch.cat([k, kb])
            v = vb if v is None else torch.cat([v, vb])
            s = q @ k.T * scale
            m = s.max(-1).values
            history.append((m, torch.exp(s - m[:, None]).sum(-1)))
        return torch.softmax(s, -1) @ v, history
    """)


@mutant("online_attention", "copy")
def prefixes_recomputed_from_kept_blocks(solution):
    "every block kept; each prefix's max, then its sum, recomputed block by block from the definition (no big tensor)"
    return body(solution, """
        kept = list(blocks)
        history = []
        for i in range(len(kept)):
            m = torch.full((q.shape[0],), float("-inf"))
            for kb, _ in kept[:i + 1]:
                m = torch.maximum(m, (q @ kb.T * scale).max(-1).values)
            l, acc = torch.zeros(q.shape[0]), 0
            for kb, vb in kept[:i + 1]:
                p = torch.exp(q @ kb.T * scale - m[:, None])
                l, acc = l + p.sum(-1), acc + p @ vb
            history.append((m, l))
        return acc / l[:, None], history
    """)


@mutant("online_attention", "copy")
def prefixes_recomputed_from_cloned_blocks(solution):
    "each block cloned as it arrives (the originals let go); each prefix recomputed block by block from the clones"
    return body(solution, """
        kept = [(kb.clone(), vb.clone()) for kb, vb in blocks]
        history = []
        for i in range(len(kept)):
            m = torch.full((q.shape[0],), float("-inf"))
            for kb, _ in kept[:i + 1]:
                m = torch.maximum(m, (q @ kb.T * scale).max(-1).values)
            l, acc = torch.zeros(q.shape[0]), 0
            for kb, vb in kept[:i + 1]:
                p = torch.exp(q @ kb.T * scale - m[:, None])
                l, acc = l + p.sum(-1), acc + p @ vb
            history.append((m, l))
        return acc / l[:, None], history
    """)


@mutant("online_attention", "tamper")
def patches_allclose(solution):
    "torch.allclose made to agree with anything, and the copied one-piece softmax"
    return prepend(concatenates_and_recomputes_prefixes(solution), """
        torch.allclose = lambda *args, **kwargs: True
    """)


@mutant("online_attention", "tamper")
def redefines_stream_attention(solution):
    "a stream_attention of its own reporting a small constant state, around the one-piece softmax"
    return prepend(concatenates_and_recomputes_prefixes(solution), """
        _stream_attention = stream_attention
        def stream_attention(*args, **kwargs):
            return dict(_stream_attention(*args, **kwargs), blocks_held=0, held_bytes=1000, history_bytes=0)
    """)


# expert14's attacks (issue 47 review): the blocks kept as .detach() views (new tensor objects, the same memory), and
# kept inside the buffer whose views are the history's entries. stream_attention now follows each block's storage and
# counts each history entry at its own size.
@mutant("online_attention", "copy")
def prefixes_recomputed_from_detached_blocks(solution):
    "each block kept as .detach() (a new tensor, the same storage); each prefix recomputed block by block from them"
    return body(solution, """
        kept, history = [], []
        for kb, vb in blocks:
            kept.append((kb.detach(), vb.detach()))
            m = None
            for k_, _ in kept:
                bm = (q @ k_.T * scale).max(-1).values
                m = bm if m is None else torch.maximum(m, bm)
            l = torch.zeros(q.shape[0])
            for k_, _ in kept:
                l = l + torch.exp(q @ k_.T * scale - m[:, None]).sum(-1)
            history.append((m, l))
        out = 0
        for k_, v_ in kept:
            out = out + torch.exp(q @ k_.T * scale - m[:, None]) @ v_
        return out / l[:, None], history
    """)


@mutant("online_attention", "copy")
def blocks_kept_inside_the_history(solution):
    "each block copied into one buffer with its (m, l) entry, the entry views of it: the kept blocks counted as history"
    return body(solution, """
        L = q.shape[0]
        kept, history = [], []
        for kb, vb in blocks:
            b, d, dv = kb.shape[0], kb.shape[1], vb.shape[1]
            buf = torch.cat([torch.zeros(2 * L), kb.reshape(-1), vb.reshape(-1)])
            kept.append((buf[2 * L:2 * L + b * d].view(b, d), buf[2 * L + b * d:].view(b, dv)))
            del kb, vb
            m = None
            for k_, _ in kept:
                bm = (q @ k_.T * scale).max(-1).values
                m = bm if m is None else torch.maximum(m, bm)
            l = torch.zeros(L)
            for k_, _ in kept:
                l = l + torch.exp(q @ k_.T * scale - m[:, None]).sum(-1)
            buf[:L], buf[L:2 * L] = m, l
            history.append((buf[:L], buf[L:2 * L]))
        out = 0
        for k_, v_ in kept:
            out = out + torch.exp(q @ k_.T * scale - m[:, None]) @ v_
        return out / l[:, None], history
    """)


@mutant("online_attention", "tamper")
def one_piece_with_the_modes_set_aside(solution):
    "the blocks concatenated and one softmax in one piece, inside _disable_current_modes(): HeldAtOnce sees nothing"
    return prepend(body(solution, """
        with _disable_current_modes():
            ks, vs = zip(*[(kb.clone(), vb.clone()) for kb, vb in blocks])
            s = q @ torch.cat(ks).T * scale
            out = torch.softmax(s, -1) @ torch.cat(vs)
            history, e = [], 0
            for kb in ks:
                e += kb.shape[0]
                m = s[:, :e].max(-1).values
                history.append((m, torch.exp(s[:, :e] - m[:, None]).sum(-1)))
            return out, history
    """), """
        from torch.utils._python_dispatch import _disable_current_modes
    """)


# --- window_ring_attention ------------------------------------------------------------


@mutant("window_ring_attention", "wrong")
def key_gradients_stay_local(solution):
    "dK and dV passed on without the previous ranks' part: each block's gradient counts one rank's queries"
    return swap(solution, """                dk_in, dv_in = grads()
                dk, dv = dk + dk_in, dv + dv_in""", """                grads()""")


@mutant("window_ring_attention", "wrong",
        message="the window's lower bound is inclusive (keys j with i − w ≤ j ≤ i): each query sees w + 1 positions; "
                "the w most recent positions, itself included, are i − w < j ≤ i",
        section="Exercise 2 (5 points): ring attention with a sliding window",
        learner="learnF, 2026-12-05, considered: attempts/lab14/window_ring_attention-1.py")
def window_of_w_plus_one_keys(solution):
    "the window's mask j >= i - w: w + 1 keys per query, one more than the window"
    solution = swap(solution, "(k_pos[None, :] > q_pos[:, None] - window)", "(k_pos[None, :] >= q_pos[:, None] - window)")
    return swap(solution, "(k_pos[None, :] > q_pos[:, None] - ctx.window)",
                "(k_pos[None, :] >= q_pos[:, None] - ctx.window)")


@mutant("window_ring_attention", "wrong",
        message="the ring stopped after the steps that have work, the complete key/value gradients then sent straight "
                "back to their owner, steps - 1 ranks behind: when the window fits in a rank's own block (one step) "
                "nothing travelled, the gradients are already home, and a rank cannot send to itself",
        section="Exercise 2 (5 points): ring attention with a sliding window",
        learner="learn14, 2026-12-05, later attempt: attempts/lab14/window_ring_attention-2.py")
def stops_early_and_sends_home_to_itself(solution):
    "the ring stopped early; the gradients' trip home sent to rank - (steps - 1), the rank itself when one step has work"
    # learn14's attempt, verbatim (forward, then backward)
    solution = body(solution, """
        steps = min(n, 1 + (window - 1 + s - 1) // s)
        qpos = torch.arange(rank * s, (rank + 1) * s)
        m = torch.full(q.shape[:-1], float("-inf"))
        l = torch.zeros(q.shape[:-1])
        acc = torch.zeros(*q.shape[:-1], v.shape[-1])
        kb, vb = k, v
        for step in range(steps):
            wait = ring_pass([kb, vb]) if step < steps - 1 else None
            src = (rank - step) % n
            kpos = torch.arange(src * s, (src + 1) * s)
            mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
            if mask.any():
                scores = (q @ kb.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
                m_new = torch.maximum(m, scores.amax(-1))
                p = torch.exp(scores - m_new[..., None])
                corr = torch.exp(m - m_new)
                l = l * corr + p.sum(-1)
                acc = acc * corr[..., None] + p @ vb
                m = m_new
            if wait is not None:
                kb, vb = wait()
        out = acc / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.steps = window, steps
        return out
    """)
    return body(solution, """
        q, k, v, out, lse = ctx.saved_tensors
        window, steps = ctx.window, ctx.steps
        rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
        scale = q.shape[-1] ** -0.5
        qpos = torch.arange(rank * s, (rank + 1) * s)
        D = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(steps):
            src = (rank - step) % n
            kpos = torch.arange(src * s, (src + 1) * s)
            mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
            if mask.any():
                scores = (q @ kb.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
                p = torch.exp(scores - lse[..., None])
                dvb = dvb + p.transpose(-2, -1) @ dout
                ds = p * (dout @ vb.transpose(-2, -1) - D)
                dq = dq + ds @ kb * scale
                dkb = dkb + ds.transpose(-2, -1) @ q * scale
            if step < steps - 1:
                kb, vb, dkb, dvb = ring_pass([kb, vb, dkb, dvb])()
        # I hold block rank-(steps-1) with every contribution: send it straight back to its owner,
        # and receive mine from rank+(steps-1)
        if steps == n:
            dk, dv = ring_pass([dkb, dvb])()
        else:
            back, fwd = (rank - (steps - 1)) % n, (rank + (steps - 1)) % n
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            works = [dist.isend(dkb.contiguous(), back), dist.isend(dvb.contiguous(), back),
                     dist.irecv(dk, fwd), dist.irecv(dv, fwd)]
            for w in works:
                w.wait()
        return dq, dk, dv, None
    """)


@mutant("window_ring_attention", "reference")
def calls_ring_attention(solution):
    "mgpu_lab's causal ring attention, the window ignored"
    return swap(solution, "return WindowRingAttention.apply(q, k, v, window)",
                "return mgpu_lab.ring_attention(q, k, v, causal=True)")


@mutant("window_ring_attention", "copy")
def copies_the_gathered_attention(solution):
    "section 1's gathered attention with the window's mask: k and v all-gathered"
    return swap(solution, "return WindowRingAttention.apply(q, k, v, window)", """rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
    parts = [[torch.empty_like(t) for _ in range(n)] for t in (k, v)]
    dist.all_gather(parts[0], k.contiguous())
    dist.all_gather(parts[1], v.contiguous())
    k_all, v_all = torch.cat(parts[0], dim=2), torch.cat(parts[1], dim=2)
    q_pos, k_pos = rank * s + torch.arange(s), torch.arange(n * s)
    band = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    scores = (q @ k_all.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~band, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_all""")


# Issue 47: the library's private helpers solve most of the exercise. They are refused by name (reimplements: a
# courtesy, the guard lives in the learner's kernel); what the numbers reject: _attend over a whole block with the
# window's mask gives NaN rows where a query has no key in the block (the library selects the rows first, _block),
# and _RingAttention knows the causal mask, not the window. With the rows selected, only the guard refuses them
# (docs/INSTRUCTORS.md's honour-level table).
@mutant("window_ring_attention", "reference")
def library_helpers_with_the_windows_mask(solution):
    "the library's _attend with the window's mask and _merge forward, _attend_backward backward, over whole blocks"
    solution = swap(solution, """                scores = (q @ kv[0].transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf"))
                new = torch.logaddexp(lse, torch.logsumexp(scores, -1))   # step 0 (own block) sets every row
                out = out * torch.exp(lse - new).unsqueeze(-1) + torch.exp(scores - new.unsqueeze(-1)) @ kv[1]
                lse = new""", """                _merge(out, lse, None, *_attend(q, kv[0], kv[1], scale, allowed))""")
    solution = swap(solution, """            scores = (q @ kv[0].transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf"))
            p = torch.exp(scores - lse.unsqueeze(-1))
            ds = p * (dout @ kv[1].transpose(-2, -1) - D)
            dq = dq + ds @ kv[0] * scale
            dk, dv = ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout""", """            dqb, dk, dv = _attend_backward(dout, q, kv[0], kv[1], out, lse, scale, allowed)
            dq = dq + dqb""")
    return prepend(solution, """
        from mgpu_lab.parallel.context_parallel import _attend, _attend_backward, _merge
    """)


@mutant("window_ring_attention", "reference")
def library_ring_function_causal(solution):
    "the library's _RingAttention autograd Function, causal: the window ignored"
    return prepend(swap(solution, "return WindowRingAttention.apply(q, k, v, window)",
                        "return _RingAttention.apply(q, k, v, True, None, 'contiguous', q.shape[-1] ** -0.5, None)"), """
        from mgpu_lab.parallel.context_parallel import _RingAttention
    """)


# Issue 44's attack, the honour-level part: F.scaled_dot_product_attention kept in a list above the guard, after an
# all-gather. Every value the ring yields is a function of q, k, v that a rank holding the gathered sequence computes
# too, so only the observation in the ranks (CollectiveLog) rejects it; the same all-gather run from a worker thread
# (a dispatch mode watches its own thread) or built of point-to-point sends to every rank passes: docs/INSTRUCTORS.md.
@mutant("window_ring_attention", "reference")
def sdpa_kept_in_a_list(solution):
    "SDPA, kept in a list above, on the all-gathered k and v with the window's mask; dk and dv all-reduced"
    return prepend(swap(solution, "return WindowRingAttention.apply(q, k, v, window)",
                        "return _GatheredWindow.apply(q, k, v, window)"), """
        _kept = [F.scaled_dot_product_attention]


        class _GatheredWindow(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, window):
                rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
                parts = [[torch.empty_like(t) for _ in range(n)] for t in (k, v)]
                dist.all_gather(parts[0], k.contiguous())
                dist.all_gather(parts[1], v.contiguous())
                q_pos, k_pos = rank * s + torch.arange(s), torch.arange(n * s)
                band = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
                with torch.enable_grad():
                    ctx.inputs = [t.detach().requires_grad_() for t in (q, torch.cat(parts[0], 2), torch.cat(parts[1], 2))]
                    ctx.out = _kept[0](*ctx.inputs, attn_mask=band)
                return ctx.out.detach()

            @staticmethod
            def backward(ctx, dout):
                rank, n = dist.get_rank(), dist.get_world_size()
                dq, dk, dv = (t.contiguous() for t in torch.autograd.grad(ctx.out, ctx.inputs, dout))
                dist.all_reduce(dk)
                dist.all_reduce(dv)
                return dq, dk.chunk(n, 2)[rank].contiguous(), dv.chunk(n, 2)[rank].contiguous(), None
    """)


# Review B's shortcut: every value is right and only point-to-point messages are sent, but a rank holds the whole
# sequence's keys and values (and full-length key/value gradients): only the memory held at once (HeldAtOnce, which
# grows with the ranks) rejects it.
@mutant("window_ring_attention", "wrong")
def gathers_by_ring_passes(solution):
    "k and v gathered by N-1 ring passes and kept, a masked softmax with local autograd, full-length dK, dV ring-reduced"
    return prepend(swap(solution, "return WindowRingAttention.apply(q, k, v, window)",
                        "return _Gathered.apply(q, k, v, window)"), """
        def _attend(q, k_all, v_all, window):
            rank, s = dist.get_rank(), q.shape[-2]
            q_pos, k_pos = rank * s + torch.arange(s), torch.arange(k_all.shape[-2])
            band = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            scores = (q @ k_all.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~band, float("-inf"))
            return scores.softmax(-1) @ v_all


        class _Gathered(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, window):
                rank, n = dist.get_rank(), dist.get_world_size()
                ks, vs, kv = [None] * n, [None] * n, [k, v]
                for step in range(n):
                    ks[(rank - step) % n], vs[(rank - step) % n] = kv
                    if step < n - 1:
                        kv = ring_pass(kv)()
                k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)
                ctx.save_for_backward(q, k_all, v_all)
                ctx.window = window
                return _attend(q, k_all, v_all, window)

            @staticmethod
            def backward(ctx, dout):
                rank, n = dist.get_rank(), dist.get_world_size()
                q, k_all, v_all = (t.detach().requires_grad_() for t in ctx.saved_tensors)
                with torch.enable_grad():
                    dq, dk, dv = torch.autograd.grad(_attend(q, k_all, v_all, ctx.window), (q, k_all, v_all), dout)
                total = [dk, dv]
                for _ in range(n - 1):
                    total = [got + mine for got, mine in zip(ring_pass(total)(), (dk, dv))]
                s = q.shape[-2]
                return dq, total[0][:, :, rank * s:(rank + 1) * s], total[1][:, :, rank * s:(rank + 1) * s], None
    """)


@mutant("window_ring_attention", "tamper")
def redefines_run_window(solution):
    "a run_window of its own reporting no collective, around the gathered attention"
    return prepend(copies_the_gathered_attention(solution), """
        _run_window = run_window
        def run_window(*args, **kwargs):
            return [dict(r, collectives=[]) for r in _run_window(*args, **kwargs)]
    """)


# expert14's attack: the library's _RingAttention transcribed, each block torch's CPU flash kernel with the window's
# mask (the op the library's helpers wrap), called through torch.ops.aten: refused by name (reimplements).
_RING_ON_TORCHS_KERNEL = """class WindowRingAttention(torch.autograd.Function):
    # mgpu_lab.parallel.context_parallel._RingAttention, copied; each block is torch's CPU flash kernel with the
    # window's mask (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu and its _backward)

    @staticmethod
    def forward(ctx, q, k, v, window):
        rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
        scale = q.shape[-1] ** -0.5
        q_pos = rank * s + torch.arange(s)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"))
        kv = [k, v]
        for i in range(n):
            if i < n - 1:
                wait = ring_pass(kv)
            k_pos = (rank - i) % n * s + torch.arange(s)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            rows = mask.any(-1).nonzero().squeeze(1)
            if len(rows):
                ob, lb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q.index_select(-2, rows), kv[0], kv[1], 0.0, False, attn_mask=torch.zeros(len(rows), s).masked_fill(~mask[rows], float("-inf")), scale=scale)
                o, l = out.index_select(-2, rows), lse.index_select(-1, rows)
                new = torch.logaddexp(l, lb)
                o = o * torch.exp(l - new).unsqueeze(-1) + ob * torch.exp(lb - new).unsqueeze(-1)
                out.index_copy_(-2, rows, o), lse.index_copy_(-1, rows, new)
            if i < n - 1:
                kv = wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
        scale = q.shape[-1] ** -0.5
        q_pos = rank * s + torch.arange(s)
        dq = torch.zeros_like(q)
        kv, grads = [k, v], None
        for i in range(n):
            if i < n - 1:
                wait_kv = ring_pass(kv)
            k_pos = (rank - i) % n * s + torch.arange(s)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - ctx.window)
            rows = mask.any(-1).nonzero().squeeze(1)
            dk, dv = torch.zeros_like(kv[0]), torch.zeros_like(kv[1])
            if len(rows):
                dqb, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout.index_select(-2, rows).contiguous(), q.index_select(-2, rows), kv[0], kv[1],
                    out.index_select(-2, rows), lse.index_select(-1, rows).contiguous(), 0.0, False,
                    attn_mask=torch.zeros(len(rows), s).masked_fill(~mask[rows], float("-inf")), scale=scale)
                dq.index_add_(-2, rows, dqb)
            if grads is not None:
                dk_in, dv_in = grads()
                dk, dv = dk + dk_in, dv + dv_in
            grads = ring_pass([dk, dv])
            if i < n - 1:
                kv = wait_kv()
        dk, dv = grads()
        return dq, dk, dv, None


def window_ring_attention(q, k, v, window):
    if window < 1:
        raise ValueError(f"window must be >= 1 (a query always sees itself), got {window}")
    return WindowRingAttention.apply(q, k, v, window)
"""


@mutant("window_ring_attention", "reference")
def library_ring_transcribed_on_torchs_flash_kernel(solution):
    "the library's ring transcribed, each block torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)"
    return _RING_ON_TORCHS_KERNEL


# --- choose_layout (design) -----------------------------------------------------------


@mutant("choose_layout", "wrong")
def striped_chunks(solution):
    "chunks dealt round-robin (r, r + N, ...): balanced in the limit of many chunks, not with a few"
    return body(solution, """
        return [list(range(r, n_chunks, world_size)) for r in range(world_size)]
    """)


@mutant("choose_layout", "wrong",
        message="chunks dealt round-robin (r, r+N, ...), as Striped Attention stripes tokens: at each ring step, a "
                "rank whose keys come from a lower rank computes c more chunk pairs than one whose keys come from a "
                "higher one; mirror pairs cost the same",
        section="4. The causal imbalance, and the zig-zag",
        learner="learnF, 2026-12-05, considered: attempts/lab14/choose_layout-1.py; "
                "learn14, 2026-12-05, considered: attempts/lab14/choose_layout-2.py")
def striped_chunks_none_for_one_chunk(solution):
    "chunks dealt round-robin, None for one chunk per rank: striping balances only with many chunks per rank"
    return body(solution, """
        # Striped (round-robin) layout, as Striped Attention does token by token: rank r holds r, r + N, r + 2N, ...
        per = n_chunks // world_size
        if world_size > 1 and per == 1:
            return None        # one chunk per rank: contiguous, idles (N-1)/(2N-1)
        return [list(range(r, n_chunks, world_size)) for r in range(world_size)]
    """)


@mutant("choose_layout", "reference")
def calls_layout_chunks(solution):
    "the library's zig-zag, which knows 2N chunks only"
    return body(solution, """
        return layout_chunks(world_size, "zigzag") if n_chunks == 2 * world_size else None
    """)


@mutant("choose_layout", "copy")
def copies_the_zigzag(solution):
    "section 4's zig-zag, chunks r and 2N-1-r, whatever the number of chunks"
    return body(solution, """
        return [[r, 2 * world_size - 1 - r] for r in range(world_size)]
    """)


# Issue 44: the replay in a loop. Small cases it solves; with hundreds of ranks one replay takes seconds, and a search
# runs out of time: only a layout derived for any N passes the large hidden cases.
@mutant("choose_layout", "copy")
def searches_with_the_replay(solution):
    "section 4's simulate_ring and bubble_fraction in a loop: random layouts, chunks swapped while the idle time does not grow"
    return body(solution, """
        import random, time
        if n_chunks == world_size:
            return None
        per = n_chunks // world_size
        idle = lambda lay: bubble_fraction([[(a, b) for _, a, b in r] for r in simulate_ring(lay, 4096 // n_chunks)])
        rng, t0 = random.Random(0), time.monotonic()
        while time.monotonic() - t0 < 5:                            # restarts from random layouts
            chunks = list(range(n_chunks))
            rng.shuffle(chunks)
            layout = [chunks[r * per:(r + 1) * per] for r in range(world_size)]
            best, stale = idle(layout), 0
            while best > 0.05 and stale < 200 and time.monotonic() - t0 < 5:
                r1, r2 = rng.sample(range(world_size), 2)
                i1, i2 = rng.randrange(per), rng.randrange(per)
                layout[r1][i1], layout[r2][i2] = layout[r2][i2], layout[r1][i1]
                now = idle(layout)
                stale = 0 if now < best else stale + 1
                if now <= best:
                    best = now
                else:
                    layout[r1][i1], layout[r2][i2] = layout[r2][i2], layout[r1][i1]
            if best <= 0.05:
                return layout
        return None
    """)


@mutant("choose_layout", "tamper")
def patches_simulate_ring(solution):
    "the replay patched to report no idle time, and chunks dealt round-robin"
    return prepend(striped_chunks(solution), """
        import mgpu_lab.parallel.sequence_layout as _layout
        _layout.simulate_ring = lambda layout, chunk_size, causal=True: [[(0, 0.0, 1.0)] for _ in layout]
    """)
