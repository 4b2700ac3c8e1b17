# origin: considered alternative
# what I believed: m can be kept in raw q.k units (as FlashAttention-2 does, applying the 1/sqrt(d) scale inside the exp); out is the same either way, so the history's m may be the raw max.
# visible check said: AssertionError: after the last block, m + log(l) should be each row's log-sum-exp
# grader said: online_attention_test 0/3 AssertionError: after the last block, m + log(l) should be each row's log-sum-exp (check line 12)
# misconception: the running max m must be in the units of the (scaled) score q k^T / sqrt(d), otherwise m + log(l) is not the row's log-sum-exp that ring attention merges with.
def online_attention(q, k, v, block_size):
    # Softmax attention of q [Lq, d] over k [Lk, d], v [Lk, dv], reading the keys block by block: (out, history).
    scale = q.shape[-1] ** -0.5
    Lq = q.shape[0]
    m = torch.full((Lq,), float("-inf"))     # running max of the raw q.k (FlashAttention-2 keeps it unscaled)
    l = torch.zeros(Lq)
    acc = torch.zeros(Lq, v.shape[-1])
    history = []
    for start in range(0, k.shape[0], block_size):
        kb, vb = k[start:start + block_size], v[start:start + block_size]
        s = q @ kb.T
        m_new = torch.maximum(m, s.max(-1).values)
        p = torch.exp((s - m_new[:, None]) * scale)
        correction = torch.exp((m - m_new) * scale)
        l = l * correction + p.sum(-1)
        acc = acc * correction[:, None] + p @ vb
        m = m_new
        history.append((m, l))
    return acc / l[:, None], history
