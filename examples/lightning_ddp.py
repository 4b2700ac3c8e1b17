"""Lab 09's training as a script: PyTorch Lightning, strategy="ddp", 2 CPU processes.

    mgpu-lab launch --nproc-per-node 2 examples/lightning_ddp.py    # torchrun starts both ranks
    python examples/lightning_ddp.py                                # Lightning starts rank 1 itself

Either way Lightning runs 2 ranks (it recognises torchrun's variables and then
starts no process of its own), bf16 autocast, 4 accumulation steps. Rank 0
prints one JSON line: world size, how the processes were started, the last loss
and a checksum of the final weights (the same for both commands).
"""
import argparse
import json
import logging
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

VOCAB, DIM, SEQ = 32, 16, 8


class LitLM(L.LightningModule):
    """Lab 06's TinyLM (frozen layer, tied weights) with its training step."""

    def __init__(self, seed=0, lr=0.5):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.lr, self.last_loss = lr, None

    def forward(self, idx):
        return self.head(torch.tanh(self.frozen(torch.tanh(self.hidden(self.embed(idx))))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB).float(), y.reshape(-1))
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    started_by = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "lightning"
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (128, SEQ), generator=g)
    loader = DataLoader(TensorDataset(x, (3 * x + 1) % VOCAB), batch_size=4)
    model = LitLM()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", precision="bf16-mixed",
                        accumulate_grad_batches=4, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        print(json.dumps({"world_size": trainer.world_size, "started_by": started_by,
                          "last_loss": round(model.last_loss, 6), "checksum": round(checksum, 9)}), flush=True)
    if torch.distributed.is_initialized():
        # Leave the group before the interpreter exits: a gloo group torn down by the
        # interpreter's own shutdown can abort a rank ("terminate called without an
        # active exception"), failing a run that had finished.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
