# origin: considered alternative
# what I believed: a k-times larger batch averages k times more samples, so the gradient's variance drops by k and its noise by sqrt(k); scaling the learning rate by sqrt(k) keeps the step's noise the same (Krizhevsky's "one weird trick" rule), so per sample the runs should track.
# visible check said: AssertionError: k=2: lr 0.1414 -> held-out loss up to 8.4% away from the single-device curve (limit 3 %)
# grader said: 0/3 AssertionError: k=2: lr 0.1414 -> held-out loss up to 8.4% away from the single-device curve (limit 3 %) (check line 12)   [--no-sandbox]
# misconception: with plain SGD one step on kB samples moves about as far as one step on B samples (same expected gradient), so matching k small steps needs k x lr (linear rule); sqrt(k) keeps the noise, not the progress per sample.
def lr_for_batch(lr, batch, new_batch):
    """Learning rate for new_batch samples per step, given lr tuned for batch samples per step (SGD)."""
    # a k-times larger batch has a k-times smaller gradient variance: scale by sqrt(k) to keep the noise of a step the same
    return lr * (new_batch / batch) ** 0.5
