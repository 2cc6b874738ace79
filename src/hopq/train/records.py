"""The records a ``hopq train`` run produces: per contender a :class:`CodecRun` of
:class:`StepRecord` s. The job (:mod:`hopq.train.job`) fills them, the report
(:mod:`hopq.train.report`) renders them, and ``runs.json`` stores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Steps at the start of every contender's run that are warm-up (numba compiles
#: the CPU kernels there where it has no cache: 21 s for DynamiQ once): left out
#: of the step times, the compute probes and the clock behind times to a loss.
WARMUP_STEPS = 1


@dataclass
class StepRecord:
    step: int
    loss: float
    #: Wall-clock of the step (forward, backward with its overlapped
    #: synchronization, optimizer), the slowest rank's.
    step_s: float
    #: The contender's compute: its latest no-communication probe + this step's optimizer.
    compute_s: float
    #: hopq's hook: seconds of codec work and of communication on its thread (they
    #: overlap the backward pass); NaN for torch's contenders.
    codec_s: float
    comm_s: float
    bytes: float
    bits_per_coord: float
    vnmse: float = float("nan")
    #: The same error with every coordinate weighed by the job's optimizer's
    #: step size (AdamW: lr / (sqrt(v) + eps)): the error of the update.
    update_vnmse: float = float("nan")
    #: The step's time beyond its compute: synchronization the backward pass did not hide.
    exposed_s: float = float("nan")
    #: This step's compute probe (NaN when none ran).
    probe_s: float = float("nan")
    #: hopq's hook: CPU seconds of its thread in the step's calls (codec kernels,
    #: hopq's Python and its socket calls; waiting not counted); NaN for torch's
    #: contenders.
    cpu_s: float = float("nan")
    #: CPU seconds per worker that the step's forward and backward used beyond
    #: the latest compute probe's, every thread of the process counted (a hook's,
    #: torch's, the backend's): what synchronization cost the cores, for every
    #: contender, torch's too (NaN before the first probe).
    sync_cpu_s: float = float("nan")
    #: hopq's hook: bytes the step's last bucket put on the link (this rank's;
    #: a two-tier call's: its node's between nodes); NaN for torch's
    #: contenders (the report takes the bucket's share of ``bytes``).
    last_bytes: float = float("nan")
    #: Seconds after the step's start (this rank's) when DDP called each bucket's
    #: hook, its gradients ready, and when the hook's future completed, in bucket
    #: order; empty for DDP's own all-reduce (no hook).
    bucket_ready_s: list[float] = field(default_factory=list)
    bucket_done_s: list[float] = field(default_factory=list)
    #: The step also ran an exact reference all-reduce (left out of timings).
    measured_error: bool = False


@dataclass
class CodecRun:
    codec: str
    params: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    #: (training wall-clock seconds, evaluation loss)
    evals: list[tuple[float, float]] = field(default_factory=list)
    #: Bytes of each of DDP's gradient buckets, in the order they are reduced
    #: (after DDP rebuilt them from the first step's order).
    bucket_bytes: list[int] = field(default_factory=list)
    #: The optimizer's class when the hook was handed it (HookState(optimizer=...):
    #: GComp's thresholds, DynamiQ's step sizes), else "".
    optimizer: str = ""
    #: codec="auto": what its planner measured and kept (one line), else "".
    plan_note: str = ""
    #: A two-tier contender's float32 tier inside the nodes, every rank's calls:
    #: "shared memory", "messages" (somewhere it kept Gloo's messages), or "".
    node_tier: str = ""
