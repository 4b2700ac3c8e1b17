# origin: considered alternative
# what I believed: each device sends the sum of its sequences' means; device 0 divides by the number of sequences in the batch, i.e. the rows (sum of the chunk sizes) — an all-padding sequence adds 0 to the sum, so it does no harm.
# visible check said: passed ("ex4 passed")
# grader said: 0/3 AssertionError: hidden check 1 of this cell failed This looks like a known misconception: divides by every sequence of the batch, the all-padding ones included (they have no loss) (see '3. The fix, part 2: the loss on every device — and its trap').   [--no-sandbox]
# misconception: an all-padding sequence adds 0 to the numerator but still 1 to a row count, so it shrinks every other sequence's weight; the denominator must be the number of sequences that keep at least one token, which each device must send.
def masked_parallel_criterion(outputs, targets, devices, ignore_index=-100):
    """Sequence-level token cross-entropy (each sequence's mean over its kept tokens, averaged over the sequences
    that keep any) from per-device logits, on devices[0]."""
    sizes = [len(o) for o in outputs]
    seq_sums = []
    for out, tgt in zip(outputs, targets.split(sizes)):
        tgt = tgt.to(out.device)
        tok = F.cross_entropy(out.flatten(0, 1), tgt.flatten(), ignore_index=ignore_index,
                              reduction="none").view(tgt.shape)               # 0 where ignored
        kept = (tgt != ignore_index).sum(dim=1)                               # kept tokens per sequence
        seq_mean = tok.sum(dim=1) / kept.clamp(min=1)
        seq_sums.append(seq_mean.sum().to(devices[0]))                        # each device sends the sum of its sequences' means
    return sum(seq_sums) / sum(sizes)                                         # ... divided by the number of sequences
