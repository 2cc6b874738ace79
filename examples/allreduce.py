"""The README's standalone example: a compressed all-reduce on an initialized
process group. Run it with ``torchrun --nproc_per_node 3 examples/allreduce.py``."""

import torch
import torch.distributed as dist

import hopq

dist.init_process_group("gloo")  # torchrun gives the rank, world size and address
rank = dist.get_rank()
t = torch.randn(1_000_000, generator=torch.Generator().manual_seed(rank))
info = hopq.all_reduce(t, codec="dynamiq", topology="butterfly", op="avg")
print(
    f"rank {rank}: {info.bits_per_coord:.2f} bits per coordinate, "
    f"{info.bytes_sent / 1e6:.2f} MB sent, {info.seconds * 1e3:.0f} ms"
)
