# origin: considered alternative
# what I believed: my cost model (reasoned, not fitted) is close enough that the first plan under both predicted budgets will also be under the measured ones; I hesitated between returning the first plan that fits and the plan with the largest margin (my first attempt, full marks).
# visible check said: AssertionError: plan A: a dict with the keys ['attention', 'embedding', 'feed_forward', 'output', 'sequence_parallel'], got None
# grader said: 0/3 — WrongCases: `answer` does not hold the cases the check asked for: None where the check expects a dict
# misconception: my memory model counted the logits twice (the output layer's logits AND cross-entropy's log-softmax, 2 x b*s*V): the output Linear keeps its input, not its output, so only ~1 b*s*V is saved; overestimating the b*s*V term by 1 bsV made every plan of scenario A look over budget (and with SP I missed a half-bsh collective).
import itertools


def plan_cost(choice, sc):
    # predicted (memory, sent) per rank on 2 ranks, in bytes
    V, h, ffn, b, s = sc["vocab"], sc["hidden"], sc["ffn"], sc["batch"], sc["seq"]
    t = 2
    sp = choice["sequence_parallel"]
    attn_split = choice["attention"] == "split"
    ffn_split = choice["feed_forward"] == "split"
    emb_split = choice["embedding"] == "vocab"
    out = choice["output"]
    # parameters: the weight, its gradient, AdamW's two moments
    params = (V * h / (t if emb_split else 1) + 4 * h * h / (t if attn_split else 1)
              + 3 * h * ffn / (t if ffn_split else 1) + V * h / (1 if out == "replicate" else t) + 3 * h)
    bsh, bsf, bsv, bs = b * s * h, b * s * ffn, b * s * V, b * s
    stream = bsh / (t if sp else 1)
    act = 0
    act += 3 * stream                                   # the three norms' inputs
    act += 2 * bsh                                      # the inputs of attention's and the ffn's first layers
    act += 5 * bsh / (t if attn_split else 1)           # q, k, v, attention's output, wo's input
    act += 4 * bsf / (t if ffn_split else 1)            # w1's and w3's outputs, silu's, w2's input
    act += bsh                                          # the output layer's input
    act += 2 * bsv / (t if out == "loss_parallel" else 1)   # the logits and log-softmax
    act += 3 * bs                                       # norms' statistics
    memory = 16 * params + 4 * act
    # traffic: ring on 2 ranks: an all-reduce sends 1x its bytes, an all-gather / reduce-scatter 1/2
    sent = 0
    if not sp:
        sent += (4 * bsh if attn_split else 0) + (3 * bsh if ffn_split else 0)
        sent += bsh if emb_split else 0
        sent += bsh if out != "replicate" else 0
    else:
        sent += 2 * bsh if attn_split else bsh
        sent += 2 * bsh if ffn_split else bsh
        sent += bsh / 2 if emb_split else 0
        sent += bsh if out != "replicate" else bsh / 2
    if out == "gather":
        sent += bsv / 2
    if out == "loss_parallel":
        sent += 3 * bs
    return memory, 4 * sent


def tp_plan(scenario):
    """A plan (a dict with the keys of CHOICES) within scenario's memory and sent budgets, on 2 ranks."""
    for values in itertools.product(*CHOICES.values()):
        choice = dict(zip(CHOICES, values))
        memory, sent = plan_cost(choice, scenario)
        if memory <= scenario["memory"] and sent <= scenario["sent"]:
            return choice                               # the first plan within both budgets
    return None
