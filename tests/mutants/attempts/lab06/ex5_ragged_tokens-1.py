# origin: considered alternative
# what I believed: Each rank back-propagates its micro-batches' weighted loss SUMS divided by the window's global weight W (all-reduced first); the ranks' pieces then add up to the global weighted mean when DDP combines the gradients, so nothing else is needed.
# visible check said: AssertionError: rank 0: gradients differ from one process's by 1.6e-01
# grader said: 0/4: AssertionError: rank 0: gradients differ from one process's by 1.6e-01 (check line 18)  [no misconception named]
# misconception: DDP's all-reduce AVERAGES the ranks' gradients (divides by the world size); to get the sum of the ranks' shares each rank must also multiply by world_size (W_ranks/N), else the gradient is world_size times too small.
def ddp_token_window(model, micro_batches):
    world = dist.get_world_size()
    local_w = sum(w.sum() for _, _, w in micro_batches).reshape(1).float()
    total = local_w.clone()
    dist.all_reduce(total)                       # the window's weight over all ranks
    W = total.item()
    local_loss = 0.0
    for i, (x, y, w) in enumerate(micro_batches):
        def step():
            per_token = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="none")
            loss_sum = (per_token * w.reshape(-1)).sum()
            (loss_sum / W).backward()            # the share of the global weight
            return loss_sum.item()
        if i < len(micro_batches) - 1:
            with model.no_sync():
                local_loss += step()
        else:
            local_loss += step()
    loss = torch.tensor([local_loss])
    dist.all_reduce(loss)
    return loss.item() / W
