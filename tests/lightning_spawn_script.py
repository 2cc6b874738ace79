"""A Lightning script as users write it: a module-level HookState handed to
HopqDDPStrategy(start_method="spawn") on 2 CPU processes. Each spawned process
re-imports this file (as ``__mp_main__``) and builds the module-level state again,
while the strategy's own copy arrives by pickling and serves the buckets; run by
tests/test_integrations_state.py, which reads what the processes print."""

import lightning as L
import torch

import hopq
from hopq.integrations import ddp as hopq_ddp
from hopq.integrations.lightning import HopqDDPStrategy

STATE = hopq.HookState(codec="bf16")


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, i):  # type: ignore[no-untyped-def]
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        calls = len(self.trainer.strategy.hook_state.calls)
        print(f"BUCKETS rank={self.trainer.global_rank} calls={calls}", flush=True)


if __name__ == "__main__":
    x = torch.randn(512, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HopqDDPStrategy(STATE, start_method="spawn"),
        max_steps=hopq_ddp.UNENGAGED_STEPS + 2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Module(), loader)
