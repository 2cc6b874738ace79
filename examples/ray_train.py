"""hopq under Ray Train's TorchTrainer, on CPU workers (Gloo) or GPUs (NCCL):

    python examples/ray_train.py --workers 2 --epochs 3 --storage-path /tmp/ray_results
    python examples/ray_train.py --workers 2 --epochs 6 --storage-path /tmp/ray_results

``hopq.integrations.ray.prepare_model`` wraps the model as
``ray.train.torch.prepare_model`` does and registers hopq's hook on it. Each
epoch reports the loss and hopq's metrics (averaged over the epoch's steps)
with ``ray.train.report``, and a checkpoint holding the model, the optimizer
and every rank's hopq state. Run again with the same ``--storage-path`` and
``--name``, Ray Train hands the latest checkpoint to ``ray.train.get_checkpoint()``
and training continues from it (above: epochs 3 to 5).
Without a running Ray cluster, ``TorchTrainer.fit`` starts a local one.
"""

import argparse
import os
import tempfile

import ray.train
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import hopq
from hopq.integrations.ray import load_state, prepare_model, save_state


def train(config: dict) -> tuple:
    """Train on one worker; return the DDP model and hopq's state."""
    device = ray.train.torch.get_device()
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    # built before prepare_model, on the same parameters, so the codec can read it
    opt = torch.optim.AdamW(net.parameters(), lr=config.get("lr", 1e-2))
    state = hopq.HookState(codec=config.get("codec", "dynamiq"), optimizer=opt)
    first = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # resuming: model, optimizer and the codec's state
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "train.pt"), weights_only=True)
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            load_state(state, d)
            first = saved["epoch"] + 1
    model = prepare_model(net, state)
    for epoch in range(first, config.get("epochs", 3)):
        g = torch.Generator().manual_seed(1000 * epoch + rank)  # each worker its own data
        comm = hopq.StepMetrics(steps=0)
        for _ in range(config.get("steps", 20)):
            x = torch.randn(32, 32, generator=g).to(device)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
            loss.backward()
            opt.step()
            opt.zero_grad()
            comm += state.pop_step()  # this step's communication
        metrics = {"epoch": epoch, "loss": loss.item(), **comm.as_dict()}
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
                torch.save({**saved, "epoch": epoch}, os.path.join(d, "train.pt"))
            save_state(state, d)  # every rank: Ray merges the directories
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
    return model, state


def train_func(config: dict) -> None:
    """What TorchTrainer runs on every worker."""
    train(config)


def main(argv=None) -> ray.train.Result:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps per epoch")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--storage-path", default=None, help="Ray's default: ~/ray_results")
    p.add_argument("--name", default="hopq-ray", help="the run; the same name resumes it")
    args = p.parse_args(argv)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"codec": args.codec, "epochs": args.epochs, "steps": args.steps},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path),
    )
    result = trainer.fit()
    print(f"{result.metrics}\ncheckpoint: {result.checkpoint}")
    return result


if __name__ == "__main__":
    main()
