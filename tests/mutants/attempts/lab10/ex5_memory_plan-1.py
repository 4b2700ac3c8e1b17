# origin: considered alternative
# what I believed: the bytes per rank of each stage are the section-1 table (zero_bytes_per_rank with 4, 4, 8): DDP 16 Psi, ZeRO-1 (8 + 8/N) Psi, ZeRO-2 (4 + 12/N) Psi, ZeRO-3 16 Psi/N
# visible check said: AssertionError: budget 768127 bytes on 3 ranks: your plan (1, 512085), want (1, 537664) (measured bytes of the fullest rank: DDP 768128, ZeRO-1 537664, ZeRO-2 422432, ZeRO-3 256048)
# grader said: 0/3: WrongCases: `plans` does not hold the cases the check asked for: a list where the check expects another type This looks like a known misconception: the ZeRO formulas (Psi/N exactly): whole parameters and padding ignored, wrong at N = 3 (see '4. Bytes per rank, measured against the formulas').
# misconception: the formulas assume Psi/N exactly; ZeRO-1/2 own whole parameters (the fullest rank of partition_parameters holds more than 1/N) and ZeRO-3 pads each unit to a multiple of N
def memory_plan(sizes, units, world_size, budget):
    psi = sum(sizes)
    for stage in range(4):
        b = zero_bytes_per_rank(psi, world_size, stage, 4, 4, 8)
        if b <= budget:
            return stage, int(b)
    return None
