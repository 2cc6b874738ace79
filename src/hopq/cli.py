"""The command line: ``hopq train`` and ``hopq bench ...``.

Options are generated from the jobs' frozen option dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _add_options(p: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        if typing.get_origin(t) is tuple:
            default: tuple[Any, ...] = f.default  # type: ignore[assignment]
            elem = typing.get_args(t)[0]
            p.add_argument(
                flag,
                nargs="+",
                type=elem if elem in (int, float, str) else str,
                default=default,
                help=f"default: {' '.join(map(str, default))}",
            )
        elif t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=t, default=f.default, help=f"default: {f.default}")


def _options(cls: type, ns: argparse.Namespace) -> Any:
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
    for k, v in kw.items():
        if isinstance(v, list):
            kw[k] = tuple(v)
    return cls(**kw)


def _emit(text: str | None, out: str | None) -> None:
    if text is None:
        return
    print(text)
    if out:
        Path(out).write_text(text + "\n")
        print(f"\nwritten to {out}")


def main(argv: Sequence[str] | None = None) -> int:
    from hopq.bench.allreduce import Options as AllreduceOptions
    from hopq.bench.train import TrainOptions

    parser = argparse.ArgumentParser(prog="hopq", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="data-parallel training with the hopq DDP hook, per codec")
    _add_options(tr, TrainOptions)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    ar = bsub.add_parser(
        "allreduce", help="nccl-tests style all-reduce timings vs torch.distributed"
    )
    _add_options(ar, AllreduceOptions)
    ar.add_argument("--out", help="also write the table to this file")
    from hopq.bench.model import ModelOptions
    from hopq.bench.vnmse import VnmseOptions

    md = bsub.add_parser("model", help="alpha-beta-gamma cost model: calibrate, predict, validate")
    _add_options(md, ModelOptions)
    md.add_argument("--out", help="also write the report to this file")

    from hopq.bench.kernels import KernelOptions

    kn = bsub.add_parser(
        "kernels", help="DynamiQ kernel time and bandwidth against a copy on the same device"
    )
    _add_options(kn, KernelOptions)
    kn.add_argument("--out", help="also write the table to this file")

    vn = bsub.add_parser("vnmse", help="compression error of every codec on real gradients")
    _add_options(vn, VnmseOptions)
    vn.add_argument("--out", help="also write the report to this file")
    ns = parser.parse_args(argv)

    if ns.cmd == "train":
        from hopq.bench import train

        _emit(train.run(_options(TrainOptions, ns)), None)  # the report folder is --out
    elif ns.cmd == "bench" and ns.bench == "allreduce":
        from hopq.bench import allreduce

        _emit(allreduce.run(_options(AllreduceOptions, ns)), ns.out)
    elif ns.cmd == "bench" and ns.bench == "model":
        from hopq.bench import model

        _emit(model.run(_options(ModelOptions, ns)), ns.out)
    elif ns.cmd == "bench" and ns.bench == "kernels":
        from hopq.bench import kernels

        _emit(kernels.run(_options(KernelOptions, ns)), ns.out)
    elif ns.cmd == "bench" and ns.bench == "vnmse":
        from hopq.bench import vnmse

        _emit(vnmse.run(_options(VnmseOptions, ns)), ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
