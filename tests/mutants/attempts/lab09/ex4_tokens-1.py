# origin: considered alternative
# what I believed: DDP's gradient all-reduce sums the ranks' gradients, so after backing the micro-batches' token-loss sums through Lightning only its division by accumulate_grad_batches has to be undone: multiply by k / (window tokens of both ranks)
# visible check said: ex4 passed (the visible part checks only the Trainer's setup and that train_loss is logged)
# grader said: 0/4 — AssertionError: hidden check 1 of this cell failed
# misconception: DDP averages the gradients over the ranks (divides the sum by the world size), so the rescaling must undo both Lightning's / k and DDP's / N: k * N / (tokens of the window on all ranks); with k alone every step is N times too small.
class TokenLitLM(L.LightningModule):
    def __init__(self, seed=0, lr=LR):
        super().__init__()
        self.model = TinyLM(seed)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    # The micro-batch's SUM of token losses goes backward; Lightning divides it by accumulate_grad_batches and
    # DDP's all-reduce sums it over the ranks. When the window is complete (on_before_optimizer_step: after the last
    # backward and DDP's all-reduce, before clipping), the window's real tokens are summed over the ranks and
    # the gradient rescaled to the per-token mean of the window.
    window_tokens = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x).reshape(-1, VOCAB).float()
        loss_sum = F.cross_entropy(logits, y.reshape(-1), reduction="sum")
        ntok = int((y != -100).sum())
        self.window_tokens += ntok
        self.log("train_loss", loss_sum.detach() / ntok, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=ntok)
        return loss_sum

    def on_before_optimizer_step(self, optimizer):
        total = torch.tensor(float(self.window_tokens), device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        factor = self.trainer.accumulate_grad_batches / total.item()   # undo Lightning's / k
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
        self.window_tokens = 0


def token_trainer_args():
    return dict(accelerator="cpu", devices=2, strategy="ddp_notebook", precision="bf16-mixed",
                accumulate_grad_batches=2, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
