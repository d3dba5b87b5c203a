"""A PyTorch Lightning script, written the way Lightning's docs write one, made resilient by one line.

A ``LightningModule`` (a small MLP with dropout, AdamW, a per-step cosine schedule), a
``LightningDataModule`` (a synthetic regression set with a random jitter on every read; a shuffled
train loader, a validation loader), ``seed_everything``, ``deterministic=True``, DDP over the
ranks, Lightning's own ``ModelCheckpoint`` and ``CSVLogger``. The one line is
``strategy=ResilientDDPStrategy(...)`` where the script had ``strategy="ddp"``.

    resilient launch --standalone --nproc-per-node 2 examples/train_lightning.py --epochs 3
    torchrun --standalone --nproc-per-node 2 examples/train_lightning.py --epochs 3
    python examples/train_lightning.py --devices 1 --epochs 1
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from resilient.integrations.lightning import ResilientDDPStrategy


class Regression(Dataset):
    """A fixed random regression set, with a random jitter on every read (the augmentation draws
    from the reading process's RNG: the main process's with ``num_workers=0``)."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 20, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) / 10 + 0.1 * torch.rand(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.01 * torch.randn(20), self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=-1, help="max_steps (optimizer steps); -1: --epochs decides")
    p.add_argument("--devices", type=int, default=2, help="processes per node (--nproc-per-node)")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--val-every", type=float, default=1.0, help="val_check_interval")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--loader", choices=("plain", "stateful"), default="plain",
                   help="stateful: torchdata's StatefulDataLoader for the training data")  # fmt: skip
    p.add_argument("--out", default="lightning_logs", help="Lightning's logs and its ModelCheckpoint files")
    packages = ["lightning.pytorch", "pytorch_lightning"]
    p.add_argument("--lightning", default=packages[0], choices=packages)
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--collective-timeout", type=float, default=None)
    p.add_argument("--ckpt-dir", default=None, help="the runtime's durable checkpoints")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--config", default=None, help="a resilient config file (configs/default.yaml)")
    args = p.parse_args()
    pl = importlib.import_module(args.lightning)  # (a user's script imports one of the two packages)
    pl_loggers = importlib.import_module(f"{args.lightning}.loggers")
    pl_callbacks = importlib.import_module(f"{args.lightning}.callbacks")

    class Data(pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            self.train, self.val = Regression(args.size, seed=1), Regression(args.size // 4, seed=2)

        def train_dataloader(self) -> DataLoader:
            if args.loader == "stateful":
                from torchdata.stateful_dataloader import StatefulDataLoader

                return StatefulDataLoader(self.train, batch_size=args.batch, shuffle=True,
                                          num_workers=args.num_workers)  # fmt: skip
            return DataLoader(self.train, batch_size=args.batch, shuffle=True, num_workers=args.num_workers)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.val, batch_size=args.batch, num_workers=args.num_workers)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
            )

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self) -> dict[str, object]:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            total = self.trainer.estimated_stepping_batches
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, int(total)))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.collective_timeout is not None:
        overrides["collective_timeout"] = args.collective_timeout
    if args.ckpt_dir:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}

    pl.seed_everything(0, workers=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ResilientDDPStrategy(config=args.config, **overrides),  # was: strategy="ddp"
        max_epochs=args.epochs,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=args.val_every,
        deterministic=True,
        # a fixed version: a relaunched job logs, and finds its checkpoints, in the same directory
        logger=pl_loggers.CSVLogger(args.out, name="", version=0),
        callbacks=[
            pl_callbacks.ModelCheckpoint(
                monitor="val_loss", save_top_k=2, save_last=True, enable_version_counter=False
            )
        ],
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), datamodule=Data())
    if trainer.is_global_zero:
        print(f"done: step {trainer.global_step} epoch {trainer.current_epoch} "
              f"val_loss {float(trainer.callback_metrics['val_loss']):.5f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
