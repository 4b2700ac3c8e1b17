# origin: considered alternative
# what I believed: the running state must not grow, so update m, l and the weighted sum in place (mul_/add_/copy_)
#   and append (m, l) to history after each block; I had a passing doubt about aliasing but expected the visible
#   check (which looks at history) to tell me.
# visible check said: online_attention passed
# grader said: 0/3  AssertionError: hidden check 3 of this cell failed: history: (m, l) after a block differ from their definitions (hidden case) The check compared `long`, `short` and the hidden check's results with the solution's, case by case: `long['history'][0][0]` is the first to differ: element 0 (counted flat, in order): expected 2.21212.
# misconception: updating the running m and l in place makes every history entry the same tensor (the final state); a bounded state still needs fresh tensors (or a snapshot) per block for the history.
def online_attention(q, blocks):
    # Softmax attention of q [Lq, d] over keys and values that arrive as (k_block [b, d], v_block [b, dv]):
    # (out, history).
    scale = q.shape[-1] ** -0.5
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
