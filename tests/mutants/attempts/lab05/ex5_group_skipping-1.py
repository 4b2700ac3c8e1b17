# origin: considered alternative
# what I believed: Exercise 2 built per-group flags for exactly this section, so I unscale the gradients myself with unscale_grads_ at 1/scaler.get_scale(), drop the overflowed groups' grads, step, and let scaler.update() adjust the scale.
# visible check said: AssertionError: No inf checks were recorded prior to update.  (raised by torch/amp/grad_scaler.py line 542, in update)
# grader said: 0/3: AssertionError: raised at line 23 of cell 52 (your code)  [torch's message 'No inf checks were recorded prior to update.' not shown; no misconception named]
# misconception: GradScaler.update() backs off only from the found-inf flags that scaler.unscale_(optimizer) records; unscaling the gradients by hand bypasses the scaler's bookkeeping, so update has nothing to decide from (and unscale_ must be the one that unscales).
def train_group_skipping(model, optimizer, batches, loss_fn, scaler, dtype=torch.float16, max_grad_norm=1.0):
    device_type = next(model.parameters()).device.type
    losses, scales, stepped = [], [], []
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=dtype):
            out = model(x)
            loss = loss_fn(out, y)
        scaler.scale(loss).backward()
        # the per-group flags of exercise 2
        inv = torch.tensor(scaler.get_scale()).double().reciprocal().float()
        groups = [[p.grad for p in group["params"] if p.grad is not None] for group in optimizer.param_groups]
        flags = unscale_grads_(groups, inv)
        ok = [bool(f == 0) for f in flags]
        for group, o in zip(optimizer.param_groups, ok):
            if not o:
                for p in group["params"]:
                    p.grad = None
        stepping = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if stepping:
            torch.nn.utils.clip_grad_norm_(stepping, max_grad_norm)
        optimizer.step()
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        stepped.append(ok)
    return losses, scales, stepped
