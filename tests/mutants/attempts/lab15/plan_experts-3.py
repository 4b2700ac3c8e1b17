# origin: first attempt
# what I believed: for each ep the smallest capacity C meeting the drop target is the cheapest (both cost terms grow
#   with C); the factor that gives C is C * E / (ep * T * k), the inverse of capacity's formula.
# visible check said: plan_experts passed (the visible factors 1.3125 and 1.21875 are exact in binary)
# grader said: 0/3 "AssertionError: check line 26 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: the factor C * E / (ep * T * k) exactly, on the capacity boundary: in floats it can come back a hair above C, and capacity's ceiling then gives C + 1 slots per expert (past the slot budget here) (see '6. Design exercise (3 points): experts per rank and a capacity factor')."
# misconception: the factor must lie strictly inside the interval ((C-1)E/(ep T k), C E/(ep T k)]; its upper end,
#   computed in floats and multiplied back by capacity(), can exceed C by an ulp and the ceiling adds a slot per expert.
#   (Honestly: the lab warns about exactly this in cell 27 and I had read it; I wrote the natural inverse in a hurry.)
def plan_experts(num_experts, world_size, tokens_per_rank, top_k, max_experts_per_rank, max_slots_per_rank,
                 max_drop_rate, row_cost, routing):
    # (ep, capacity factor) of the lowest step cost meeting the memory, buffer and drop-rate targets, or None.
    import math
    E, W, T, k = num_experts, world_size, tokens_per_rank, top_k
    allowed = math.floor(max_drop_rate * routing.numel())        # assignments we may drop
    best = None
    for ep in range(1, W + 1):
        if W % ep or E % ep or E // ep > max_experts_per_rank:
            continue
        per = E // ep
        places = [slot_positions(routing[s:s + ep].reshape(-1, k), E) for s in range(0, W, ep)]
        everything = torch.cat([p.reshape(-1) for p in places]).sort(descending=True).values
        C = int(everything[allowed]) + 1 if allowed < len(everything) else 0   # smallest C dropping <= allowed
        if per * C > max_slots_per_rank:
            continue
        busiest = 0
        for g, s in enumerate(range(0, W, ep)):
            kept = places[g] < C
            for j in range(ep):
                mine = routing[s + j]                                   # [T, k]
                home = mine // per
                busiest = max(busiest, int((kept[j * T:(j + 1) * T] & (home != j)).sum()))
        cost = per * C + row_cost * busiest
        cf = C * E / (ep * T * k)
        if best is None or cost < best[0]:
            best = (cost, ep, cf)
    return None if best is None else (best[1], best[2])
