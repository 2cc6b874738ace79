"""Faults on real Gloo groups (DESIGN: agreement before bytes move, hopq's own
timeouts, a transport that checks every size). Generated from the codec
registry; ``hopq bench faults`` runs the same code for docs/reliability/faults.md."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hopq
from hopq.bench import faults
from hopq.cluster.launch import run_workers, spawn
from tests.workers import (
    aborts_at_exit,
    ddp_group_freed_on_destroy,
    environ_of,
    group_freed_on_destroy,
    make_input,
    plan_fails_everywhere,
    plan_fails_on_one_rank,
    setsid_of,
    straggler,
    wrong_sizes,
)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_mismatch_raises_on_every_rank_and_the_group_recovers(n):
    o = faults.FaultOptions(worlds=(n,), deaths=())
    per_rank = faults.run_mismatches(o, n)
    kinds_seen = set()
    for rows in per_rank:
        for codec, topo, kind, what, _ in rows:
            if kind == "recovery":
                xs = [faults._input(q, o.size) for q in range(n)]
                want = hopq.simulate(xs, codec, topo, seed=1).outputs[0]
                assert torch.equal(what, want), (codec, topo)
            elif kind == "refused call":  # refused on rank 0, whose peers are told
                want_what = (
                    "refused (TypeError)" if what.startswith("refused") else "TransportError"
                )
                assert what == want_what, (codec, topo, kind, what)
                kinds_seen.add(kind)
            elif kind == "oversize message":  # its receiver raises, the others are told
                assert what in ("PayloadError", "TransportError"), (codec, topo, what)
                kinds_seen.add(kind)
            else:
                assert what == "MismatchError", (codec, topo, kind, what)
                kinds_seen.add(kind)
    assert kinds_seen == set(faults.MISMATCHES)  # every kind applied to some codec
    refused = [w for rows in per_rank for _, _, k, w, _ in rows if k == "refused call"]
    assert refused.count("refused (TypeError)") == len(refused) // n  # rank 0's, once a case
    longer = [w for rows in per_rank for _, _, k, w, _ in rows if k == "oversize message"]
    # its receivers raise PayloadError, unless a peer's notice reached them first
    assert longer.count("PayloadError") >= len(longer) // (2 * n)
    # every codec with options or adaptive state got those mismatches too
    configs = {(c, t) for rows in per_rank for c, t, k, *_ in rows if k == "config"}
    assert {c for c, _ in configs} >= {"dynamiq", "mxfp8", "thc", "omnireduce"}


DEATH_CASES = [(kind, 3, topo) for kind in faults.DEATHS for topo in ("ring", "butterfly")] + [
    ("dies mid-step", 2, "ring"),
    ("never calls", 2, "butterfly"),
    ("dies after its first send", 4, "ring"),
    ("dies in the statistics exchange", 4, "butterfly"),
]


@pytest.mark.parametrize("kind, n, topo", DEATH_CASES)
def test_a_dead_or_silent_rank_makes_every_survivor_raise_in_time(kind, n, topo):
    o = faults.FaultOptions(timeout=3.0)
    codec = "dynamiq" if kind == "dies in the statistics exchange" else "bf16"
    r = faults.run_death(o, kind, n, topo, codec)
    outcome = faults.survivor_outcomes(r, faults.death_timeout(o, kind))
    assert sum(outcome.values()) == n - 1, outcome
    assert all(k.startswith("TransportError") and k.endswith(" in time") for k in outcome), (
        outcome,
        [x.error for x in r.outcomes],
    )
    for out in r.outcomes:
        if out.rank != r.victim:
            assert "rank" in out.result[2]  # the message names a peer
            if kind == "raises an exception":  # told, well before the 60 s deadline
                assert f"rank {r.victim}" in out.result[2] and out.result[1] < 15.0, out.result


def test_a_plan_failing_on_every_rank_leaves_the_group_usable():
    n = 3
    res = run_workers(n, plan_fails_everywhere)
    xs = [make_input("float", q, 4000) for q in range(n)]
    want = hopq.simulate(xs, "dynamiq", "ring").outputs[0]
    for r in res:
        assert r["failed"] == "ValueError: this plan refuses"
        assert torch.equal(r["after"], want)


def test_a_plan_failing_on_one_rank_is_told_to_its_peers_at_once():
    """A plan that raises on one rank before its agreement message went out:
    its peers raise TransportError naming it within seconds (not at their
    timeout), also where their call skips the agreement round, and the next
    call on the group is correct."""
    n = 3
    res = run_workers(n, plan_fails_on_one_rank)
    xs = [make_input("float", q, 4000) for q in range(n)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    for name in ("dynamiq", "bf16"):
        for r, out in enumerate(res):
            msg, seconds = out[name]
            if r == 1:
                assert msg == "ValueError: this plan refuses", msg
            else:
                assert msg.startswith("TransportError") and "rank 1" in msg, (name, r, msg)
                assert seconds < 10, (name, r, seconds)
            # the next call: the same bits on every rank, the codec's accuracy
            after = out[(name, "after")]
            assert torch.equal(after, res[0][(name, "after")]), (name, r)
            err = float((after.double() - exact).square().sum() / exact.square().sum())
            assert err < 0.1, (name, err)
    want = hopq.simulate(xs, "bf16", "ring").outputs[0]
    assert torch.equal(res[0][("bf16", "after")], want)


def test_wrong_sizes_are_caught_without_stale_bytes_or_aborts():
    res = run_workers(3, wrong_sizes)
    for extra in (-1, 1):
        # the lying rank refuses to send; the others learn it from the header
        assert res[0][f"liar{extra}"] == "CodecError", res[0].get(f"liar{extra}/msg")
        for r in (1, 2):
            assert res[r][f"liar{extra}"] == "TransportError"
    assert "has 10 bytes, the plan says 20" in res[1]["short"]


def test_the_readme_example_exits_cleanly_under_torchrun():
    """Every rank of every launch exits 0 (hopq bench exits --runs 30 for the docs)."""
    from hopq.bench import exits

    root = Path(__file__).resolve().parents[1]
    text = exits.run(exits.ExitOptions(runs=2, nproc=3, script=str(root / exits.EXAMPLE)))
    assert "**2 exited 0**, 0 failed" in text, text


def test_no_codec_turns_finite_input_into_nan_or_inf():
    """``hopq bench ranges`` over every codec: the 'NaN/Inf from finite' column is 0."""
    from hopq.bench import ranges

    text = ranges.run(ranges.RangeOptions(world_size=3, size=67))
    rows = [r for r in text.splitlines() if r.startswith("|") and "---" not in r][1:]
    assert len(rows) >= 9
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert cells[3] == "0", r
        assert "NaN/Inf!" not in r


def test_the_launcher_says_where_a_rank_died():
    """A rank that aborts after its work is done is a failure, and the message
    says that it got that far (so a teardown fault is told from a crash)."""
    with pytest.raises(RuntimeError, match=r"exit code -6 \(after the process group was destroyed"):
        run_workers(2, aborts_at_exit)


def test_ranks_see_the_launchers_environment_and_run_their_exit_handlers(tmp_path, monkeypatch):
    """The ranks fork from a server that started with the first launch: each
    still sees the launcher's environment as it is when the ranks start (a
    variable set or removed since), and its exit handlers run when its
    function returns, as at a script's end."""
    names = ["HOPQ_LAUNCH_CHECK", "TRITON_INTERPRET"]
    assert "TRITON_INTERPRET" in os.environ  # set before any launch (conftest)
    run_workers(1, environ_of, names, str(tmp_path / "first"))  # the server runs
    monkeypatch.setenv("HOPQ_LAUNCH_CHECK", "set after the server started")
    monkeypatch.delenv("TRITON_INTERPRET")
    res = run_workers(2, environ_of, names, str(tmp_path / "gone"))
    want = {"HOPQ_LAUNCH_CHECK": "set after the server started", "TRITON_INTERPRET": None}
    assert res == [want, want]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first0", "gone0", "gone1"]


def test_each_rank_calls_setsid_as_under_torchrun():
    """As torchrun starts its workers: where Linux's scheduler groups processes
    by ``setsid()`` (autogroup), ranks in one group would share one CPU share."""
    res = run_workers(3, setsid_of)
    assert all(r["sid"] == r["pid"] == r["pgid"] for r in res), res
    assert os.getsid(0) not in {r["sid"] for r in res}


def test_destroying_the_group_frees_it_after_hopq_used_it():
    """hopq's transport cache holds groups weakly: destroy_process_group frees the
    group (and Gloo's threads) at once, not during interpreter finalization,
    where a Gloo thread that needs the GIL aborts a finished rank."""
    outs = spawn(2, group_freed_on_destroy, clean_exit=False, timeout=300)
    assert [o.error for o in outs] == [None, None]
    assert [o.result for o in outs] == [True, True]


def test_destroying_the_group_frees_it_after_ddp_used_it(tmp_path):
    """torch's DDP imports torch.distributed.nn.functional, whose default
    arguments capture the group on import: hopq imports it first, so DDP with the
    hook leaves nothing holding the group; where it was imported while a group
    lived, hopq's exit handler releases the destroyed group."""
    outs = spawn(2, ddp_group_freed_on_destroy, str(tmp_path), clean_exit=False, timeout=300)
    assert [o.error for o in outs] == [None, None]
    want = {"ddp": True, "held by the defaults": True, "released at exit": True}
    assert [o.result for o in outs] == [want, want]


def test_a_rank_killed_by_a_signal_leaves_its_threads_stacks():
    """faulthandler writes every thread's Python stack when a rank aborts, even
    at interpreter exit, and the error shows it."""
    with pytest.raises(RuntimeError) as e:
        run_workers(2, aborts_at_exit)
    assert "threads when it died" in str(e.value)
    assert "Fatal Python error: Aborted" in str(e.value)


@pytest.mark.parametrize("size", [1 << 20, 1 << 16])
def test_mismatches_where_the_statistics_ride_with_the_agreement(size):
    """At 1M coordinates DynamiQ's statistics take the direct all-reduce, whose
    first round rides with the agreement (a tail per peer); at 64K coordinates
    their whole all-gather rides (the same tail to every peer). A rank making
    another call (another codec sends no tails, another size other tails) still
    raises MismatchError with every other rank, and the group stays usable."""
    o = faults.FaultOptions(
        worlds=(4,), deaths=(), codecs=("dynamiq",), topologies=("ring",), size=size,
        mismatches=("size", "codec", "config", "seed"),
    )  # fmt: skip
    per_rank = faults.run_mismatches(o, 4)
    for rows in per_rank:
        kinds = [kind for _, _, kind, *_ in rows]
        assert kinds == ["size", "codec", "config", "seed", "recovery"], kinds
        for codec, topo, kind, what, _ in rows:
            if kind == "recovery":
                xs = [faults._input(q, o.size) for q in range(4)]
                assert torch.equal(what, hopq.simulate(xs, codec, topo, seed=1).outputs[0])
            else:
                assert what == "MismatchError", (kind, what)


def test_a_call_waits_as_long_as_the_process_group_does():
    """With no timeout given, a call waits for a late peer as long as the group's
    own timeout (init_process_group(timeout=)), as torch's collectives do: a
    rank 4 s late is waited for under a 20 s group timeout, and under a 2 s one
    the early rank gives up in about 2 s while the late rank's error says that
    its peer gave up waiting."""
    outs = spawn(2, straggler, 4.0, pg_timeout=20, clean_exit=False, timeout=300)
    assert [o.error for o in outs] == [None, None]
    assert [o.result["timeout_s"] for o in outs] == [20.0, 20.0]
    assert [o.result.get("ok") for o in outs] == [3.0, 3.0]
    outs = spawn(2, straggler, 4.0, pg_timeout=2, clean_exit=False, timeout=300)
    early, late = (o.result for o in outs)
    assert "within the call's timeout of 2 s" in early["error"], early
    assert early["waited_s"] < 4.0
    assert "gave up waiting for this rank" in late["error"], late
    assert "step -" not in early["error"] + late["error"]  # no internal step numbers


def test_calls_without_a_process_group_say_so():
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="init_process_group first"):
        hopq.all_reduce(x)
    with pytest.raises(RuntimeError, match="init_process_group first"):
        hopq.reduce_scatter(x, shards="equal")


def test_the_default_timeout_follows_the_backend():
    """NCCL: 90% of the group's timeout (hopq raises before NCCL's watchdog
    kills the process); a group whose timeout cannot be read: a warning, once,
    and 30 minutes."""
    import datetime
    import types

    from hopq.comm import transport as tr

    def fake(backend, group):
        t = tr.DistTransport.__new__(tr.DistTransport)
        t.backend, t._warned_timeout, t._warned_cap = backend, False, False
        t._group = lambda: group
        return t

    opts = types.SimpleNamespace(
        options=types.SimpleNamespace(_timeout=datetime.timedelta(minutes=10))
    )
    group = types.SimpleNamespace(_get_backend=lambda device: opts)
    assert fake("nccl", group).timeout_s == pytest.approx(540.0)
    assert fake("gloo", group).timeout_s == 600.0
    # on NCCL a caller's timeout beyond that would let the watchdog end the
    # process first: capped, once with a warning
    nccl = fake("nccl", group)
    with pytest.warns(RuntimeWarning, match="longer than this NCCL group allows"):
        assert nccl.call_timeout(3600) == pytest.approx(540.0)
    assert nccl.call_timeout(100) == 100
    assert nccl.call_timeout(None) == pytest.approx(540.0)
    assert fake("gloo", group).call_timeout(3600) == 3600
    blind = fake("gloo", object())  # no _get_backend
    with pytest.warns(RuntimeWarning, match="could not read the process group's timeout"):
        assert blind.timeout_s == tr.FALLBACK_TIMEOUT_S
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blind.timeout_s == tr.FALLBACK_TIMEOUT_S  # warned once


def test_batched_posts_and_staged_messages():
    """The transport's NCCL path as NCCL answers it (one work for a whole
    coalesced batch: every handle waits on it) and its staging (a message in
    the memory its backend does not take is posted as a copy; a received one is
    copied to its own buffer when waited on). The fake backend delivers by
    filling the posted receive buffers."""
    import types

    from hopq.comm import transport as tr
    from hopq.comm.framing import Deadline, Where

    class Work:
        def __init__(self, recvs):
            self.recvs, self.waits = recvs, 0

        def wait(self, timeout=None):
            self.waits += 1
            for t in self.recvs:
                t.fill_(7)
            return True

    works = []

    def batch(ops):
        works.append(Work([o[1] for o in ops if o[0] == "irecv"]))
        return works[-1:]

    fake = types.SimpleNamespace(
        isend="isend", irecv="irecv", batch_isend_irecv=batch,
        P2POp=lambda op, t, peer, group, tag=0: (op, t, peer),
    )  # fmt: skip
    t = tr.DistTransport.__new__(tr.DistTransport)
    t._dist, t._group, t._global, t.rank = fake, lambda: object(), [0, 1, 2], 0
    t.prepost, t.backend, t.staged_messages, t._batching = False, "nccl", 0, None
    t._stage_to = {"cpu": torch.device("cpu")}  # stage CPU messages (to the CPU: a copy)
    out = [torch.zeros(3, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)]
    sent = torch.ones(4, dtype=torch.uint8)
    s, r = t.post([(1, sent)], [(1, out[0]), (2, out[1])])
    assert len(works) == 1 and t.staged_messages == 3
    assert [h.peer for h in s + r] == [1, 1, 2]
    for h in s + r:
        h.wait(Deadline(5.0), Where("a call", 0, 0))
    assert works[0].waits == 3
    assert all(bool((o == 7).all()) for o in out)  # copied from the staged buffers
    assert bool((sent == 1).all())  # a send's copy, not the tensor itself, was posted
    # posts inside a batch go out as one group when it closes; waiting earlier is a bug
    with t.batch():
        s1, _ = t.post([(1, sent)], [])
        _, r1 = t.post([], [(2, out[0])])
        assert len(works) == 1
        with pytest.raises(RuntimeError, match="before its batch was posted"):
            s1[0].wait(Deadline(5.0), Where("a call", 0, 0))
    assert len(works) == 2
    r1[0].wait(Deadline(5.0), Where("a call", 0, 0))


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_ranks_die_with_their_launcher(tmp_path, sig):
    """A launcher (hopq train, a benchmark) stopped by SIGTERM or killed leaves no
    rank behind waiting on its peers with its cores busy (seen: SIGTERM to `hopq
    train --no-network` left its 4 ranks running)."""
    root = Path(__file__).resolve().parents[1]
    code = (
        "from hopq.cluster.launch import spawn\n"
        "from tests.workers import sleep_forever\n"
        f"spawn(2, sleep_forever, {str(tmp_path)!r})\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=root)
    try:
        end = time.monotonic() + 120
        while len([p for p in tmp_path.iterdir() if p.name in ("0", "1")]) < 2:
            assert time.monotonic() < end and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
        os.kill(launcher.pid, sig)
        launcher.wait(timeout=60)
        end = time.monotonic() + 30
        while not all(_gone(p) for p in pids):
            assert time.monotonic() < end, f"ranks {pids} outlived their launcher"
            time.sleep(0.2)
        if sig == signal.SIGTERM:
            assert launcher.returncode == 128 + signal.SIGTERM  # SystemExit, after the kill
    finally:
        if launcher.poll() is None:
            launcher.kill()
