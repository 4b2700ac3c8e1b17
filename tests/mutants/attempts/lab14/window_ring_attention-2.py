# origin: later attempt
# what I believed: with a window w, only 1 + ceil((w-1)/s) ring steps have work (the text: "which blocks have work
#   depends on w and s"), so stop the ring there; the block held at the last step then has all its gradient
#   contributions and goes straight back to its owner, steps-1 ranks behind, by isend/irecv.
# visible check said: window_ring_attention passed
# grader said: 0/5  LaunchError: raised in a hidden part of the check's probe
# misconception: when the window fits in the rank's own block (steps == 1) no block travelled and the gradients are
#   already home; my code sent them to rank - 0 = itself, which gloo refuses ("Pair is not connected").
# kind: edge case of the trip home (own run, 4 ranks, window 1: RuntimeError ... pair.cc:801 state_ >= CONNECTED. 1 vs 4. Pair is not connected)
class WindowRingAttention(torch.autograd.Function):
    # Sliding-window causal attention over the whole sequence; rank r holds positions r*s ... (r+1)*s - 1.
    # The ring stops once no rank has work left: with a window w, query r*s sees keys back to r*s - w + 1,
    # i.e. blocks r, r-1, ..., r - ceil((w-1)/s): steps = 1 + ceil((w-1)/s), at most n.

    @staticmethod
    def forward(ctx, q, k, v, window):
        rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
        scale = q.shape[-1] ** -0.5
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

    @staticmethod
    def backward(ctx, dout):
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


def window_ring_attention(q, k, v, window):
    if window < 1:
        raise ValueError(f"window must be >= 1 (a query always sees itself), got {window}")
    return WindowRingAttention.apply(q, k, v, window)
