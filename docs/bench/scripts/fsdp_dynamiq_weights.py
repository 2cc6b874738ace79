"""DynamiQ's step-size weights under FSDP on the GPT's real gradients: the table
of docs/integrations/fsdp.md's "DynamiQ's step-size weights".

    python docs/bench/scripts/fsdp_dynamiq_weights.py

4 Gloo ranks, hopq's GPT (4 layers, width 256), fully_shard per encoder layer
and the root, AdamW (lr 1e-3), 4 sequences per rank, 40 steps, DynamiQ with
optimizer=. At steps 10, 20, 30 and 39 every reduce-scatter is captured with a
copy of the codec as the call found it (its weights set) and each rank's step
sizes for its slice. Each call is then replayed in the simulator with and
without the weights (the same inputs, the same budget share): the gradient's
vNMSE and the update's error, sum (r e)^2 / sum (r x)^2 per coordinate, as
HookState's hopq/update_vnmse. About 3 minutes on 2 cores."""

import copy
import statistics as st

import torch

import hopq
from hopq.cluster.launch import run_workers

STEPS, CAPTURE = 40, (10, 20, 30, 39)


def worker(rank: int, n: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hopq.codecs.dynamiq.optim import step_sizes
    from hopq.train.workloads import gpt

    torch.set_num_threads(1)
    wl = gpt(seed=0)
    model = wl.model
    mesh = init_device_mesh("cpu", (n,))
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state: dict = {"on": False, "calls": []}

    class Capturing(hopq.FSDPReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            rec = None
            if state["on"]:
                params, _ = self._params(output_tensor.numel())
                r = step_sizes(opt, [fp.sharded_param for fp in params]) if params else None
                rpad = None
                if r is not None:  # this rank's slice, FSDP's padding at 0
                    total = sum(fp.padded_sharded_param_size.numel() for fp in params)
                    rpad = r.new_zeros(total)
                    at = src = 0
                    for fp in params:
                        k = fp.sharded_param.to_local().numel()
                        rpad[at : at + k] = r[src : src + k]
                        at += fp.padded_sharded_param_size.numel()
                        src += k
                rec = {"key": self.key, "inp": input_tensor.detach().clone(), "r": rpad}
                codec = self.codec
                real_set = codec.set_supergroup_weights

                def spy(w, key=None, spent_bits=0.0, _rec=rec):  # type: ignore[no-untyped-def]
                    real_set(w, key, spent_bits)
                    snap = copy.deepcopy(codec)
                    snap.__dict__.pop("set_supergroup_weights", None)
                    _rec.update(snap=snap, spent=spent_bits)

                codec.set_supergroup_weights = spy
            try:
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            finally:
                if rec is not None:
                    self.codec.__dict__.pop("set_supergroup_weights", None)
                    rec["out"] = output_tensor.detach().clone()
                    state["calls"].append(rec)

    comm = Capturing("dynamiq", seed=7, optimizer=opt)
    comm.install(model)
    losses = []
    for step in range(STEPS):
        state["on"] = step in CAPTURE
        loss = wl.loss(model, wl.batch(0, rank, step, 4))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        comm.pop_step()
    return {"calls": state["calls"], "losses": losses}


def main() -> None:
    n = 4
    res = run_workers(n, worker, timeout=1800)
    print(
        f"training loss, rank 0: step 0 {res[0]['losses'][0]:.4f}, last {res[0]['losses'][-1]:.4f}"
    )
    print(
        "| key | coordinates | vNMSE with / without | update error with / without | bits with (exchange) / without | replay = real |"
    )
    print("|---:|---:|---|---|---|---|")
    ua, ub = [], []
    op = torch.distributed.ReduceOp.AVG  # FSDP's for float32 gradients
    for i, rec in enumerate(res[0]["calls"]):
        if "snap" not in rec:
            continue
        recs = [res[q]["calls"][i] for q in range(n)]
        inputs = [c["inp"] for c in recs]
        r = torch.cat([c["r"] for c in recs]).double()
        exact = torch.stack([x.double() for x in inputs]).sum(0) / n

        def replay(codec, rec=rec, inputs=inputs):  # type: ignore[no-untyped-def]
            return hopq.simulate_reduce_scatter(
                inputs, codec, "ring", seed=7, op=op, key=rec["key"]
            )

        def errors(sim, exact=exact, r=r):  # type: ignore[no-untyped-def]
            e = torch.cat([o.double() for o in sim.outputs]) - exact
            v = float(e.square().sum() / exact.square().sum())
            u = float((r * e).square().sum() / (r * exact).square().sum())
            return v, u

        a = replay(copy.deepcopy(rec["snap"]))
        bare = copy.deepcopy(rec["snap"])
        bare.set_supergroup_weights(None, rec["key"])
        b = replay(bare)
        same = all(torch.equal(recs[q]["out"], a.outputs[q]) for q in range(n))
        (va, xa), (vb, xb) = errors(a), errors(b)
        ua.append(xa)
        ub.append(xb)
        print(
            f"| {rec['key']} | {inputs[0].numel():,} | {va:.2e} / {vb:.2e} | {xa:.2e} / {xb:.2e} "
            f"| {a.bits_per_coord:.3f} (+{rec['spent']:.3f}) / {b.bits_per_coord:.3f} "
            f"| {'yes' if same else 'NO'} |"
        )
    ratios = [x / y for x, y in zip(ua, ub, strict=True)]
    print(
        f"\n{len(ua)} calls: update error median {st.median(ua):.3e} with the weights, "
        f"{st.median(ub):.3e} without; ratio median {st.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); higher with them in {sum(x > 1 for x in ratios)}"
    )


if __name__ == "__main__":
    main()
