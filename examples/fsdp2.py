"""FSDP2 with hopq's compressed reduce-scatter: a small MLP, ``fully_shard`` per
layer, a few SGD steps, the bits per coordinate each step put on the wire.

Run it with ``torchrun --nproc_per_node 2 examples/fsdp2.py`` (CPU and Gloo; on
GPUs it takes NCCL and CUDA). ``--codec`` and ``--topology`` pick any registered
codec and topology (``hopq codecs`` lists them). ``--adamw`` trains with AdamW
instead of SGD; ``--optimizer`` hands the optimizer to a codec that reads it:
GComp's optimizer-aware mantissa truncation (thresholds exchanged every
``--thresholds-every`` steps; ``--truncate`` says the same), DynamiQ's bit
allocation weighed by AdamW's step sizes (the ranks exchange each slice's
super-group weights at every call).
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hopq

parser = argparse.ArgumentParser()
parser.add_argument("--codec", default="dynamiq")
parser.add_argument("--topology", default="ring")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--adamw", action="store_true", help="AdamW (lr 1e-3) instead of SGD")
parser.add_argument(
    "--optimizer",
    "--truncate",
    action="store_true",
    help="hand the codec the optimizer (GComp's truncation, DynamiQ's step-size weights)",
)
parser.add_argument("--thresholds-every", type=int, default=10, help="GComp's exchanges")
args = parser.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")  # torchrun gives rank and address
rank, n = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)  # the same initial model on every rank
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
    torch.nn.Linear(512, 10),
).to(device)  # fmt: skip
mesh = init_device_mesh(device.type, (n,))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

if args.adamw:
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
# one line: every FSDP module's reduce-scatter becomes hopq's, each with its own key
extra: dict = {"optimizer": opt} if args.optimizer else {}
if args.optimizer and args.codec == "gcomp":
    extra["thresholds_every"] = args.thresholds_every
comm = hopq.FSDPReduceScatter(args.codec, topology=args.topology, **extra)
comm.install(model)

g = torch.Generator().manual_seed(rank)  # each rank its own data
for step in range(args.steps):
    x = torch.randn(32, 256, generator=g).to(device)
    y = torch.randint(0, 10, (32,), generator=g).to(device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    # this step's reduce-scatters on this rank, summed (step_metrics(): a flat dict);
    # DynamiQ's budget holds averaged over the ranks, so one rank may print a little more
    m = comm.pop_step()
    if rank == 0:
        print(
            f"step {step}: loss {loss.item():.4f}, {m.buckets} reduce-scatters, "
            f"{m.bits_per_coordinate:.2f} bits per coordinate ({args.codec}, {args.topology})"
        )
dist.destroy_process_group()
