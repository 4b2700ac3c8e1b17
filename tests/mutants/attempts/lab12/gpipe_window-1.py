# origin: considered alternative
# what I believed: I hesitated between weighting each micro-batch by n_k/window_samples (my first attempt, passed) and keeping the schedules' 1/m per micro-batch and only weighting each step by its batch's share of the window (len(batch)/window_samples): I thought 'not 1/m of one step' meant the step had to be rescaled for the window.
# visible check said: AssertionError: 2 stages, stage 0: after the window, gradients differ from one process's by 0.017570994794368744 (largest); the window's loss is the mean over all its samples
# grader said: 0/4 — AssertionError: check line 20 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: 1/(m x steps): right for equal micro-batches and batches, wrong for 10 samples in 3, 3, 2, 2 (see '2. GPipe: micro-batches fill the pipeline'). [misconception: scaled_by_one_over_m_times_steps]
# misconception: 1/m inside a step treats unequal micro-batches (3, 3, 2, 2) as equal: each micro-batch's mean loss must be weighted by its own sample count, n_k / window_samples, not by (1/m) x (batch / window).
def gpipe_step(stage, n_microbatches, loss_fn, window_samples, x=None, target=None, losses=None):
    """One GPipe step of this rank's `stage` inside an accumulation window of `window_samples` samples."""
    if stage.is_first and x is None:
        raise ValueError("the first stage's step needs the batch: x=")
    if stage.is_last and target is None:
        raise ValueError("the last stage's step needs target=")
    m = n_microbatches
    xs = torch.tensor_split(x, m) if stage.is_first else [None] * m
    ts = torch.tensor_split(target, m) if stage.is_last else [None] * m
    stage.reset()
    outs = [stage.forward_one_chunk(k, xs[k]) for k in range(m)]
    for k in range(m):
        loss = None
        if stage.is_last:
            loss = loss_fn(outs[k], ts[k])
            if losses is not None:
                losses.append(loss.detach())
            loss = loss / m * (len(target) / window_samples)   # 1/m of the step, the step weighted by its share of the window
        stage.backward_one_chunk(k, loss)
    stage.finish()
    if stage.is_last:
        return torch.cat([o.detach() for o in outs])
    return None
