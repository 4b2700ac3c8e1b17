# origin: considered alternative (a second reading of cell 27's third target)
# what I believed: "the fraction of assignments dropped — each EP group applying MoE's rule to its ranks' tokens — is
#   at most max_drop_rate" means each EP group must keep its own drop fraction under the target, so C is the largest
#   C any group needs.
# visible check said: plan_experts passed (the visible check does not check the cost; my costs were 210 (ep 8) instead of 205, and 278)
# grader said: 0/3 "AssertionError: hidden check 2 of this cell failed This looks like a known misconception: the drop-rate target required of every EP group separately: it bounds the fraction of all the step's assignments dropped (summed over the groups), so this buys more slots than needed (see '6. Design exercise (3 points): experts per rank and a capacity factor')."
# misconception: the drop target bounds the fraction over all the step's assignments (all groups together); asking it
#   of every group separately buys more slots than needed, here a plan 2.4 % dearer than the cheapest.
def plan_experts(num_experts, world_size, tokens_per_rank, top_k, max_experts_per_rank, max_slots_per_rank,
                 max_drop_rate, row_cost, routing):
    # (ep, capacity factor) of the lowest step cost meeting the memory, buffer and drop-rate targets, or None.
    import math
    E, W, T, k = num_experts, world_size, tokens_per_rank, top_k
    best = None
    for ep in range(1, W + 1):
        if W % ep or E % ep or E // ep > max_experts_per_rank:
            continue
        per = E // ep
        places = [slot_positions(routing[s:s + ep].reshape(-1, k), E) for s in range(0, W, ep)]
        # every EP group must meet the drop target on its own tokens: the largest C any group needs
        C = 0
        for p in places:
            allowed = math.floor(max_drop_rate * p.numel())
            desc = p.reshape(-1).sort(descending=True).values
            C = max(C, int(desc[allowed]) + 1 if allowed < len(desc) else 0)
        if per * C > max_slots_per_rank:
            continue
        busiest = 0
        for g, s in enumerate(range(0, W, ep)):
            kept = places[g] < C
            for j in range(ep):
                home = routing[s + j] // per
                busiest = max(busiest, int((kept[j * T:(j + 1) * T] & (home != j)).sum()))
        cost = per * C + row_cost * busiest
        cf = (C - 0.5) * E / (ep * T * k)                          # inside the interval that gives C
        if best is None or cost < best[0]:
            best = (cost, ep, cf)
    return None if best is None else (best[1], best[2])
