# origin: considered alternative
# what I believed: "weight each rank's gradient by its n_r before the sum, and divide by N after": N is the number of
#   ranks, as everywhere else in this lab (the ring on N ranks), and the cell hands me `world` for that division.
# visible check said: AssertionError: 3 + 5 rows, rank 0: differs from one process on the full batch by 4.66e-01
# grader said: 0/3 AssertionError: check line 13 failed (its message is withheld: it would show hidden cases) The check compared the hidden check's results with the solution's, case by case: a hidden case first differs: values that differ beyond the tolerance.
# misconception: after weighting by n_r and summing, the divisor is the total sample count N = sum of n_r (one extra all-reduce), not the world size: sum_r n_r g_r / W is (N/W) times the full-batch gradient.
def sync_gradients(model, num_samples):
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        p.grad *= num_samples
        dist.all_reduce(p.grad)
        p.grad /= world
