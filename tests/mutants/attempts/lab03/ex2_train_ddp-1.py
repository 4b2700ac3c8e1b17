# origin: considered alternative
# what I believed: to make every sample weigh 1/N, scale each rank's mean loss by n_r / N (its share of the samples).
# visible check said: AssertionError: 0.weight differs from one process: with shards of 40 and 24, each rank's loss must count its share
# grader said: 0/3  AssertionError: 0.weight differs from one process: with shards of 40 and 24, each rank's loss must count its share (check line 19)
# misconception: DDP then still divides the summed gradients by world_size, so n_r / N gives the full-batch gradient
#   divided by W; the factor must be n_r * W / N to undo DDP's averaging.
def train_ddp(x_local, y_local, steps=30, lr=0.2):
    device = rank_device()
    model = make_model().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    x_local, y_local = x_local.to(device), y_local.to(device)
    world = dist.get_world_size()
    n = torch.tensor([float(len(x_local))], device=device)
    dist.all_reduce(n)                      # N: all ranks' samples
    n_total = n.item()
    factor = len(x_local) / n_total  # each sample weighs 1/N
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(ddp(x_local), y_local)
        opt.zero_grad()
        (loss * factor).backward()
        opt.step()
        total = loss.detach() * len(x_local)
        dist.all_reduce(total)
        losses.append(total.item() / n_total)
    return {k: v.cpu() for k, v in ddp.module.state_dict().items()}, losses
