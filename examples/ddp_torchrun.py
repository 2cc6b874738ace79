"""hopq's DDP hook in a plain PyTorch loop, with the metrics logged to
TensorBoard (``SummaryWriter``) or W&B (offline), on two CPU processes:

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --steps 20
    tensorboard --logdir runs/examples/ddp
    WANDB_MODE=offline torchrun --nproc_per_node 2 examples/ddp_torchrun.py --logger wandb

One line registers the hook; ``state.step_metrics()`` gives each step's bits
per coordinate, bytes and seconds as flat scalars, for any logger.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hopq


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--logger", choices=["tensorboard", "wandb", "none"], default="tensorboard")
    p.add_argument("--out", default="runs/examples/ddp")
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun gives the rank, world size and address
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    ddp = DDP(model)
    state = hopq.HookState(codec=args.codec)
    ddp.register_comm_hook(state, hopq.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    log = None  # one run per rank: each logs its own communication
    if args.logger == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(f"{args.out}/rank{rank}")

        def log(metrics, step):
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
    elif args.logger == "wandb":
        import wandb  # WANDB_MODE=offline: written under ./wandb, sync later

        run = wandb.init(project="hopq-example", name=f"rank{rank}", dir=args.out)

        def log(metrics, step):
            run.log(metrics, step=step)

    g = torch.Generator().manual_seed(rank)
    metrics: dict = {}
    for step in range(args.steps):
        x = torch.randn(32, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics = {"loss": loss.item(), **state.step_metrics()}
        if log is not None:
            log(metrics, step)
    if args.logger == "tensorboard":
        writer.close()
    elif args.logger == "wandb":
        run.finish()
    print(f"rank {rank}: {json.dumps(metrics)}")
    return metrics


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
