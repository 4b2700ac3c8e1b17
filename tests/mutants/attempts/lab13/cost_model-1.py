# origin: considered alternative
# what I believed: FSDP all-gathers and reduce-scatters once per micro-batch (section 5's byte prediction multiplies FSDP's collectives by K, the micro-batches per step), so the cost model's FSDP term is m times per step.
# visible check said: cost model passed   (the lab's example dp=8, tp=4, m=4, selective gave 4.397 s here, not 3.869 s)
# grader said: cost_model_test 0/4 AssertionError: hidden check 1 of this cell failed
# misconception: the cost model counts FSDP's 2 all-gathers and 1 reduce-scatter of 2N/(tp*pp) bytes once per step (parameters kept gathered over the accumulation window), not once per micro-batch as the small run of section 5 does.
def predict(layout, model, cluster, global_batch):
    """(seconds per step, bytes per GPU) of `layout` under the cost model above."""
    dp, tp, pp, m, rec = layout["dp"], layout["tp"], layout["pp"], layout["m"], layout["recompute"]
    L, h, a, V, s = model["layers"], model["hidden"], model["heads"], model["vocab"], model["seq"]
    gpus = dp * tp * pp
    per_node = cluster["gpus_per_node"]
    N = 12 * L * h * h + 2 * V * h
    tokens = global_batch * s
    b = global_batch // (dp * m)
    flops = tokens * (6 * N + 12 * L * h * s)
    if rec == "full":
        flops += tokens * (2 * N + 4 * L * h * s)
    elif rec == "selective":
        flops += tokens * 4 * L * h * s
    compute = flops / (gpus * cluster["peak_flops"] * cluster["efficiency"])
    bubble = (pp - 1) / m * compute

    def link(size, stride):
        return cluster["nvlink"] if size * stride <= per_node else cluster["network"]

    act = b * s * h * 2                                   # bf16 activations of a micro-batch
    n_ar = 6 if rec == "full" else 4
    t_tp = m * (L // pp) * n_ar * 2 * (tp - 1) / tp * act / link(tp, 1) if tp > 1 else 0.0
    shard = 2 * N / (tp * pp)
    t_dp = m * 3 * (dp - 1) / dp * shard / link(dp, tp) if dp > 1 else 0.0   # per micro-batch, as section 5's FSDP
    t_pp = 2 * m * act / link(pp, tp * dp) if pp > 1 else 0.0
    seconds = compute + bubble + t_tp + t_dp + t_pp

    params = 16 * N / gpus
    if rec == "none":
        per_layer = s * b * h * (34 + 5 * a * s / h) / tp
    elif rec == "selective":
        per_layer = 34 * s * b * h / tp
    else:
        per_layer = 2 * s * b * h / tp
    memory = params + (L // pp) * min(m, pp) * per_layer
    return seconds, memory


def choose_layout(model, cluster, global_batch):
    """The fastest valid layout that fits in cluster["memory"], by your predict()."""
    gpus = cluster["nodes"] * cluster["gpus_per_node"]
    best = None
    for tp in range(1, gpus + 1):
        if gpus % tp or model["heads"] % tp:
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or model["layers"] % pp:
                continue
            dp = gpus // (tp * pp)
            for m in range(1, global_batch // dp + 1):
                if global_batch % (dp * m):
                    continue
                for rec in ("none", "selective", "full"):
                    layout = dict(dp=dp, tp=tp, pp=pp, m=m, recompute=rec)
                    t, mem = predict(layout, model, cluster, global_batch)
                    if mem <= cluster["memory"] and (best is None or t < best[0]):
                        best = (t, layout)
    return None if best is None else best[1]
