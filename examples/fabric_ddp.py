"""hopq under Lightning Fabric: two CPU processes, metrics through ``fabric.log_dict``.

    python examples/fabric_ddp.py --steps 20      # Fabric starts the second process

Fabric's own ``DDPStrategy`` has no hook option (it hands unknown arguments to
DDP, which rejects ``ddp_comm_state``); ``HopqDDPStrategy`` registers the hook
on the module ``fabric.setup`` wraps.
"""

import argparse
import json

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

import hopq
from hopq.integrations.fabric import HopqDDPStrategy


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="runs/examples/fabric")
    args = p.parse_args(argv)
    strategy = HopqDDPStrategy(hopq.HookState(codec=args.codec))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, loggers=CSVLogger(args.out))
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(fabric.global_rank)
    metrics: dict = {}
    for step in range(args.steps):
        x = torch.randn(32, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        metrics = {"loss": loss.item(), **strategy.hook_state.step_metrics()}
        fabric.log_dict(metrics, step=step)  # Fabric's loggers write from rank 0
    fabric.logger.finalize("success")  # flush the CSV file
    print(f"rank {fabric.global_rank}: {json.dumps(metrics)}")
    return metrics


if __name__ == "__main__":
    main()
