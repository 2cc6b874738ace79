"""hopq under Hugging Face Accelerate, on CPU processes:

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py --steps 20
    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --steps 20     # the same

The hook goes on the model ``accelerator.prepare`` returns
(``DistributedDataParallelKwargs(comm_hook=...)`` would silently ignore it).
"""

import argparse
import json

import torch
from accelerate import Accelerator

import hopq
from hopq.integrations.accelerate import register_hook


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(2048, 32)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32
    )
    model, opt, data = accelerator.prepare(model, opt, data)
    state = register_hook(accelerator, model, hopq.HookState(codec=args.codec))
    metrics: dict = {}
    for step, (xb, yb) in enumerate(data):
        if step == args.steps:
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        metrics = {"loss": loss.item(), **state.step_metrics()}
        accelerator.log(metrics, step=step)  # to the trackers given to Accelerator(log_with=...)
    print(f"rank {accelerator.process_index}: {json.dumps(metrics)}")
    return metrics


if __name__ == "__main__":
    main()
