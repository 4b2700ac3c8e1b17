# origin: considered alternative
# what I believed: "the w most recent positions, itself included" read as keys j with i - w <= j <= i (I hesitated between >= and > on the lower bound and tried the inclusive one).
# visible check said: AssertionError: 2 ranks, window 3: output differs from attention on the gathered sequence
# grader said: window_ring_attention_test 0/5 AssertionError: check line 21 failed (its message is withheld: it would show hidden cases)
# misconception: a window of w positions that includes the query itself is i - w < j <= i; the lower bound j >= i - w lets every query see w + 1 keys.
class WindowRingAttention(torch.autograd.Function):
    # Sliding-window causal attention over the whole sequence; rank r holds positions r*s ... (r+1)*s - 1.

    @staticmethod
    def forward(ctx, q, k, v, window):
        rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
        scale = q.shape[-1] ** -0.5
        qpos = rank * s + torch.arange(s)
        m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        l = torch.zeros(q.shape[:-1], dtype=q.dtype)
        acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        kb, vb = k, v
        for step in range(n):
            wait = ring_pass([kb, vb]) if step < n - 1 else None
            src = (rank - step) % n
            kpos = src * s + torch.arange(s)
            mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= qpos[:, None] - window)
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
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        window = ctx.window
        rank, n, s = dist.get_rank(), dist.get_world_size(), q.shape[-2]
        scale = q.shape[-1] ** -0.5
        qpos = rank * s + torch.arange(s)
        D = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kb, vb, dkb, dvb = k, v, torch.zeros_like(k), torch.zeros_like(v)
        for step in range(n):
            src = (rank - step) % n
            kpos = src * s + torch.arange(s)
            mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= qpos[:, None] - window)
            if mask.any():
                scores = (q @ kb.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
                p = torch.exp(scores - lse[..., None])
                dvb = dvb + p.transpose(-2, -1) @ dout
                ds = p * (dout @ vb.transpose(-2, -1) - D)
                dq = dq + ds @ kb * scale
                dkb = dkb + ds.transpose(-2, -1) @ q * scale
            if step < n - 1:
                kb, vb, dkb, dvb = ring_pass([kb, vb, dkb, dvb])()
        dk, dv = ring_pass([dkb, dvb])()      # one more hop: home to the owner
        return dq, dk, dv, None


def window_ring_attention(q, k, v, window):
    if window < 1:
        raise ValueError(f"window must be >= 1 (a query always sees itself), got {window}")
    return WindowRingAttention.apply(q, k, v, window)
