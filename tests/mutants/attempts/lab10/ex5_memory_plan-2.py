# origin: considered alternative
# what I believed: ZeRO-1/2 need the real partition (whole parameters), but FSDP's flat shards 'split every unit exactly', so ZeRO-3 holds 16 Psi / N
# visible check said: AssertionError: budget 422431 bytes on 3 ranks: your plan (3, 256042), want (3, 256048) (measured bytes of the fullest rank: DDP 768128, ZeRO-1 537664, ZeRO-2 422432, ZeRO-3 256048)
# grader said: 0/3: WrongCases: `plans` does not hold the cases the check asked for: a list where the check expects another type (no misconception named)
# misconception: each FSDP unit's flat vector is padded to a multiple of N, so a rank holds 16 * sum over units of ceil(numel_u / N) bytes, not 16 Psi / N
def memory_plan(sizes, units, world_size, budget):
    psi = sum(sizes)
    owned = [sum(sizes[i] for i in idx) for idx in partition_parameters([s * 4 for s in sizes], world_size)]
    most = max(owned)
    plans = [16 * psi, 8 * psi + 8 * most, 4 * psi + 12 * most, 16 * psi // world_size]
    for stage, b in enumerate(plans):
        if b <= budget:
            return stage, b
    return None
