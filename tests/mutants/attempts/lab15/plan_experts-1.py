# origin: considered alternative
# what I believed: every assignment whose expert lives on another rank of the group is a row sent in the dispatch all-to-all, whether or not its expert's capacity keeps it
# visible check said: plan_experts passed
# grader said: 3/3 (full marks: the visible and hidden cases did not tell it apart)
# misconception: a dropped assignment is not sent (ExpertParallelMoE drops before the all-to-all), so only kept assignments to other ranks count in the dispatch term; counting dropped ones overprices small capacities and large ep
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
            drops, sent = 0, []
            for s in range(0, W, ep):
                pos = slot_positions(routing[s:s + ep].reshape(-1, k), E)
                kept = pos < C
                drops += int((~kept).sum())
                for j in range(ep):
                    ex = routing[s + j]
                    kj = kept[j * T:(j + 1) * T]
                    sent.append(int((ex // per != j).sum()))
            if drops > max_drop_rate * routing.numel():
                continue
            cost = per * C + row_cost * max(sent)
            if best is None or cost < best[0]:
                best = (cost, ep, cf)
            break
    return None if best is None else (best[1], best[2])
