"""Benchmarks (``hopq bench ...``): all-reduce timings against torch.distributed
(:mod:`.allreduce`), kernel bandwidth (:mod:`.kernels`), compression error on real
gradients (:mod:`.vnmse`) and the alpha-beta-gamma cost model (:mod:`.cost_model`)."""
