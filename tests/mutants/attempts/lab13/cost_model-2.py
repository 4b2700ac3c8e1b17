# origin: considered alternative (what I believed from the text before my own measurements showed otherwise)
# what I believed: a full recompute runs each block's whole forward again in backward, so both sub-blocks'
#   reduce-scatters (wo's and w2's outputs) are sent again: 2L more reduce-scatters of b*s*h per micro-batch
#   (section 2: "recomputing a reduce-scatter sends its bytes a second time"), besides the 2L all-gathers again.
# visible check said: cost model passed
# grader said: 0/4 AssertionError: hidden check 3 of this cell failed: a small layout's bytes are not what rank 0's sockets carried: FSDP's collectives per micro-batch, TP's per block under each recompute (section 2, lab 07), gloo's reduce-scatter (section 5) The check compared `chosen`, `predictions` and the hidden check's results with the solution's, case by case: `predictions[0]['seconds']` is the first to differ: its value: expected 0.0039031.
# misconception: torch's non-reentrant checkpoint stops recomputing once the last saved tensor backward needs is rebuilt, so a full recompute reruns only the attention's reduce-scatter (wo), not the feed-forward's (w2), whose output nothing in backward needs: L extra reduce-scatters per micro-batch, not 2L.
def predict(layout, model, cluster, global_batch):
    """One GPU's (rank 0's) optimizer step under `layout` (dp, tp, m, recompute), section 2's plan:
    {"seconds": ..., "sent": bytes, "state": bytes, "activations": bytes}."""
    dp, tp, m, rc = layout["dp"], layout["tp"], layout["m"], layout["recompute"]
    L, h, a, V, s = model["layers"], model["hidden"], model["heads"], model["vocab"], model["seq"]
    by = model["bytes"]
    b = global_batch // (dp * m)
    up = lambda x, n: -(-x // n)

    # rank 0's piece of each parameter: tp first (rows of colwise/embeddings/output, columns of rowwise), then dp rows
    col = lambda out, inp: up(up(out, tp), dp) * inp
    row = lambda out, inp: up(out, dp) * up(inp, tp)
    block = 3 * col(h, h) + row(h, h) + col(4 * h, h) + row(h, 4 * h) + 2 * up(h, dp)
    piece = L * block + 2 * up(up(V, tp), dp) * h + up(up(s, tp), dp) * h + up(h, dp)
    state = 16 * piece

    gloo = cluster["backend"] == "gloo"
    # FSDP over dp, every micro-batch: each unit all-gathered forward and backward, its gradient reduce-scattered
    ag = (dp - 1) * piece                     # numbers a rank sends for one all-gather of every unit
    fsdp = m * (2 * ag * by["gather"] + (2 if gloo else 1) * ag * by["reduce"])
    # TP/SP over tp, per micro-batch, tensors of b*s*h
    T, f = b * s * h, (tp - 1) / tp
    n_ag = (2 * L + 1) + 2 * L + 1            # forward gathers, backward gathers (wo/w2 outputs' grads, tok's)
    n_rs = 2 * L + 1 + (2 * L + 1)            # forward: wo, w2, tok; backward: the gathers' gradients
    if rc == "selective":
        n_ag += 2 * L
    elif rc == "full":
        n_ag += 2 * L
        n_rs += 2 * L                         # the whole block runs again: both sub-blocks reduce-scatter again
    act = by["activations"]
    tp_bytes = f * ((n_ag * T + s * h) * act + (2 if gloo else 1) * (n_rs * T + s * h) * act)   # + pos's
    tp_bytes += 2 * f * (2 * L + 1) * h * 4   # the norms' weight gradients, all-reduced
    tp_bytes += 2 * f * 3 * b * s * 4         # loss_parallel's three all-reduces
    tp_bytes *= m
    sent = fsdp + tp_bytes

    per_layer = {"none": s * b * h * (34 + 5 * a * s / h) / tp, "selective": 34 * s * b * h / tp,
                 "full": 2 * s * b * h / tp}[rc]
    activations = L * per_layer

    N = L * 12 * h * h + V * h
    per_token = 6 * N + 12 * L * h * s
    if rc == "selective":
        per_token += 4 * L * h * s
    elif rc == "full":
        per_token += 2 * L * 12 * h * h + 4 * L * h * s
    flops = global_batch * s * per_token / (dp * tp)
    g = cluster["gpus_per_node"]
    tp_link = cluster["nvlink"] if tp <= g else cluster["network"]
    dp_link = cluster["nvlink"] if (dp - 1) * tp < g else cluster["network"]
    seconds = flops / (cluster["peak_flops"] * cluster["efficiency"]) + tp_bytes / tp_link + fsdp / dp_link
    return {"seconds": seconds, "sent": sent, "state": state, "activations": activations}


def choose_layout(model, cluster, global_batch):
    """The fastest valid layout (a dict like predict's `layout`) whose state and activations fit in
    cluster["memory"], by your predict()."""
    gpus = cluster["nodes"] * cluster["gpus_per_node"]
    best = None
    for tp in range(1, gpus + 1):
        if gpus % tp or model["heads"] % tp:
            continue
        dp = gpus // tp
        for m in range(1, global_batch + 1):
            if global_batch % (dp * m):
                continue
            for rc in ("none", "selective", "full"):
                layout = dict(dp=dp, tp=tp, m=m, recompute=rc)
                p = predict(layout, model, cluster, global_batch)
                if p["state"] + p["activations"] <= cluster["memory"] and (best is None or p["seconds"] < best[0]):
                    best = (p["seconds"], layout)
    return best[1]
