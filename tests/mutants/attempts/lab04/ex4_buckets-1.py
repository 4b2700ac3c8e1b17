# origin: considered alternative
# what I believed: a bucket is full once its size has reached its cap (torch's DDP packing, which I know), so add the
#   parameter first and close the bucket when size >= cap.
# visible check said: AssertionError: TiedNet, bucket_cap_mb=0.0001 (first bucket too): [['hidden.bias', 'hidden.weight'], ['embed.weight']]; BucketedDDP: [['hidden.bias'], ['hidden.weight'], ['embed.weight']]
# grader said: 0/2  WrongCases: `mine` does not hold the cases the check asked for: fewer items than the check asked for
# misconception: the lab's rule closes the bucket BEFORE a parameter that would make it exceed its cap (a bucket
#   never exceeds its cap; a parameter larger than the cap gets a bucket of its own); closing only after the cap is
#   reached lets a bucket overshoot and packs a small parameter together with a large one.
def make_buckets(named_parameters, bucket_cap_mb, first_bucket_mb):
    cap, first_cap = bucket_cap_mb * 2**20, first_bucket_mb * 2**20
    buckets = []
    current, size = [], 0
    for name, p in reversed(named_parameters):
        if not p.requires_grad:
            continue
        current.append(name)
        size += p.numel() * p.element_size()
        limit = first_cap if not buckets else cap
        if size >= limit:            # the bucket is full once it has reached its cap (as torch's DDP packs)
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
