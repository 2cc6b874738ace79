"""hopq under Lightning's Trainer: two CPU processes, the metrics through ``self.log_dict``.

    python examples/lightning_ddp.py --steps 20     # Lightning starts the second process

``HopqDDPStrategy`` registers the hook on CPU and GPU alike (Lightning's own
``DDPStrategy(ddp_comm_hook=...)`` does it only on CUDA). The metrics go to
Lightning's CSV logger under ``--out``; the last step's are printed.
"""

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import hopq
from hopq.integrations.lightning import HopqDDPStrategy


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # after the backward: this step's buckets, as flat scalars for any logger
        self.log_dict(self.trainer.strategy.hook_state.step_metrics())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="runs/examples/lightning")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(2048, 32)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HopqDDPStrategy(hopq.HookState(codec=args.codec)),
        max_steps=args.steps,
        logger=CSVLogger(args.out),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=32))
    last = {k: float(v) for k, v in trainer.logged_metrics.items()}
    print(f"rank {trainer.global_rank}: {json.dumps(last)}")
    return last


if __name__ == "__main__":
    main()
