# origin: considered alternative
# what I believed: each rank knows its own window's tokens without communication; if every rank's gradient is its own per-token mean, DDP's average over the ranks gives the per-token mean of the whole window
# visible check said: ex4 passed (the visible part checks only the Trainer's setup and that train_loss is logged)
# grader said: 0/4 — AssertionError: hidden check 1 of this cell failed This looks like a known misconception: divides by this rank's tokens of the window: DDP's average over ranks then weights ranks equally (see '10. Design: token-weighted accumulation across ranks, clipped, in mixed precisio').
# misconception: The average of the ranks' per-token means is the mean of means again: ranks whose windows hold different numbers of real tokens must be weighted by their tokens, so the count has to be summed over the ranks (an all-reduce) before dividing.
class TokenLitLM(L.LightningModule):
    def __init__(self, seed=0, lr=LR):
        super().__init__()
        self.model = TinyLM(seed)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    # The micro-batch's SUM of token losses goes backward; Lightning divides it by accumulate_grad_batches.
    # When the window is complete (on_before_optimizer_step, before clipping), the gradient is rescaled by
    # the window's real tokens.
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
        # this rank's tokens of the window: each rank's gradient becomes its per-token mean, DDP averages them
        factor = self.trainer.accumulate_grad_batches / self.window_tokens
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
        self.window_tokens = 0


def token_trainer_args():
    return dict(accelerator="cpu", devices=2, strategy="ddp_notebook", precision="bf16-mixed",
                accumulate_grad_batches=2, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
