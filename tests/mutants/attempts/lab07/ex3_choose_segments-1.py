# origin: considered alternative
# what I believed: Measuring every k is slow; section 4 gives the memory after forward as M(k) = (k-1) a + (n/k) b (a = a segment's input, b = one block's saved bytes), so I can model the saved bytes of each k from one plain measurement and pick the cheapest k that fits.
# visible check said: AssertionError: budget 36864 bytes: k = 9 keeps 40960 bytes
# grader said: 0/3: AssertionError: budget 36864 bytes: k = 9 keeps 40960 bytes (check line 14)  [no misconception named]
# misconception: M(k) ~ (k-1)a + (n/k)b is only an approximation: checkpoint_sequential puts the remainder of n/k into the last, un-checkpointed segment (n - (k-1)floor(n/k) blocks), so for a k that does not divide n the model underestimates and the chosen k does not fit; measure (or model the real last segment).
def choose_segments(blocks, x, budget_bytes):
    n = len(blocks)
    # section 4's model: M(k) = (k - 1) a + (n / k) b, a = a segment input, b = one block's saved bytes
    a = x.numel() * x.element_size()
    b = saved_tensor_bytes(blocks, x) / n
    best = None
    for k in range(1, n + 1):
        saved = (k - 1) * a + n / k * b
        if saved > budget_bytes:
            continue
        cost = (k - 1) * (n // k)
        if best is None or cost < best[0]:
            best = (cost, k)
    return None if best is None else best[1]
