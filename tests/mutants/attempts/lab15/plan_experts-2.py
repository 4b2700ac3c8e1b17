# origin: considered alternative
# what I believed: the drop-rate target is per EP group (each group applying MoE's rule): every group's fraction of dropped assignments must be at most max_drop_rate
# visible check said: plan_experts passed
# grader said: 0/3: AssertionError: hidden check 2 of this cell failed: the plan meets the targets but another costs over 2 % less: count the slots and the rows the busiest rank sends to other ranks (section 6)
# misconception: the target is the fraction of all assignments of the step (summed over the groups) that are dropped; requiring it of every group separately is stricter and forces a larger capacity than needed
def plan_experts(num_experts, world_size, tokens_per_rank, top_k, max_experts_per_rank, max_slots_per_rank,
                 max_drop_rate, row_cost, routing):
    # (ep, capacity factor) of the lowest step cost meeting the memory, buffer and drop-rate targets, or None.
    E, W, T, k = num_experts, world_size, tokens_per_rank, top_k
    best = None
    for ep in range(1, W + 1):
        if W % ep or E % ep:
            continue
        per = E // ep
        if per > max_experts_per_rank:
            continue
        for C in range(1, max_slots_per_rank // per + 1):
            cf = C * E / (ep * T * k)
            worst, sent = 0.0, []
            for s in range(0, W, ep):
                pos = slot_positions(routing[s:s + ep].reshape(-1, k), E)
                kept = pos < C
                worst = max(worst, float((~kept).float().mean()))
                for j in range(ep):
                    ex = routing[s + j]
                    kj = kept[j * T:(j + 1) * T]
                    sent.append(int((kj & (ex // per != j)).sum()))
            if worst > max_drop_rate:
                continue
            cost = per * C + row_cost * max(sent)
            if best is None or cost < best[0]:
                best = (cost, ep, cf)
            break
    return None if best is None else (best[1], best[2])
