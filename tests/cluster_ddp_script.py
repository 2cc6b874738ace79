"""A tiny data-parallel training under torchrun with hopq's DDP hook, for
tests/test_cluster_launch.py: each rank writes its layout (torchrun's
variables), its network namespace and a digest of its final parameters to
``--out``/rank<RANK>.json.

    torchrun --nnodes 2 --nproc_per_node 2 ... tests/cluster_ddp_script.py --out DIR
"""

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hopq


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layout", default="", help="hopq's two-tier layout (auto, NxG); empty: flat")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun gives the rank, world size and store
    rank = dist.get_rank()
    torch.manual_seed(0)
    # 3,265 parameters: node-shards of 1,632, which DynamiQ serves itself (sizes
    # too small for its budget run bf16, hopq.RunStats.fallback)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 1))
    ddp = DDP(model)
    state = hopq.HookState(codec=args.codec, layout=args.layout or None)
    ddp.register_comm_hook(state, hopq.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)  # every rank its own data
    for _ in range(args.steps):
        x = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    record = {
        "params": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "loss": loss.item(),
        "metrics": state.step_metrics(),
        "netns": os.stat("/proc/self/ns/net").st_ino,  # which namespace (node) it ran in
        **{
            k: os.environ.get(k)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        },
    }
    dist.barrier()
    dist.destroy_process_group()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
