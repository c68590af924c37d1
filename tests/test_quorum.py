"""Replicas that survive each other (torch_mpmd/parallel/quorum.py): two
torchrun jobs of a 2-rank pipeline each (tests/quorum_worker.py) meet in a
torchft Lighthouse run by this process. A rank of replica 1 is SIGKILLed (or
stalls) once it joined step 5's quorum; replica 0 never restarts, does not
commit the step it could not finish, and trains alone; torchrun restarts
replica 1, which rejoins, is healed from replica 0 (parameters, optimizer,
step count, data position) and ends equal to it bitwise. Every committed
step's loss and every gradient equal one process on the participants'
batches, replayed here with the same participation."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft")  # installed by scripts/setup.sh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quorum_worker as qw  # noqa: E402

import torch_mpmd as mpmd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
END = 10                 # both replicas stop at a step past this that both took part in
HEARTBEAT_MS = 2000      # the Lighthouse drops a replica silent this long
RTOL, ATOL = 1e-5, 1e-6  # fp32, AdamW's steps included


def _launch(tmp: Path, lighthouse: str, replica: int, env: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
               TORCHFT_LIGHTHOUSE=lighthouse, QUORUM_OUT=str(tmp), REPLICA=str(replica),
               QUORUM_END=str(END), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "1", str(ROOT / "tests" / "quorum_worker.py")]
    log = open(tmp / f"replica{replica}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _run(tmp: Path, fault: dict[str, str], tokens: bool) -> dict:
    from torchft._torchft import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=HEARTBEAT_MS,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=HEARTBEAT_MS)
    common = {"QUORUM_TOKENS": "1"} if tokens else {}
    try:
        jobs = [_launch(tmp, lighthouse.address(), 0, common),
                _launch(tmp, lighthouse.address(), 1, {**common, **fault})]
        deadline = time.time() + 300
        for job in jobs:
            job.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        lighthouse.shutdown()
    logs = {r: (tmp / f"replica{r}.log").read_text()[-4000:] for r in (0, 1)}
    assert [job.returncode for job in jobs] == [0, 0], logs
    return {(r, rank, launch): torch.load(tmp / f"replica{r}_rank{rank}_{launch}.pt",
                                          weights_only=False)
            for r, launch in ((0, 0), (1, 0), (1, 1)) for rank in (0, 1)}


def _history(out: dict) -> dict[int, tuple[int, list[int]]]:
    """The quorum's committed steps, from every replica's records: step
    number -> (data position, the replicas that took part). A replica that
    joins late is healed with steps another replica took alone."""
    history: dict[int, tuple[int, set[int]]] = {}
    for (replica, rank, _launch), data in out.items():
        for rec in data["records"]:
            if rec["committed"]:
                position, who = history.setdefault(rec["step"], (rec["position"], set()))
                assert position == rec["position"], (rec, position)
                who.add(replica)
    for step, (position, who) in history.items():
        counts = {rec["participants"] for data in out.values() for rec in data["records"]
                  if rec["committed"] and rec["step"] == step}
        assert counts == {len(who)}, (step, counts, who)
    assert sorted(history) == list(range(1, max(history) + 1)), sorted(history)
    return {step: (position, sorted(who)) for step, (position, who) in history.items()}


def _reference(history: dict[int, tuple[int, list[int]]], tokens: bool
               ) -> dict[int, tuple[float, dict[str, torch.Tensor]]]:
    """Loss and gradients of every committed step, replayed in one process on
    the participants' batches, with AdamW stepping as the replicas do."""
    model = qw.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {}
    for step in sorted(history):
        position, who = history[step]
        opt.zero_grad()
        batches = [qw.batch(r, position) for r in who]
        if tokens:
            parts = [qw.token_loss(model(x), (y, keep)) for x, y, keep in batches]
            loss = sum(s for s, _ in parts) / sum(n for _, n in parts)
        else:
            loss = sum(qw.mean_loss(model(x), y) for x, y, _ in batches) / len(batches)
        loss.backward()
        out[step] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return out


def _check(out: dict, tokens: bool) -> None:
    survivor = out[(0, 0, 0)]["records"]
    # Both ranks of a replica decided every step alike.
    for r, launch in ((0, 0), (1, 0), (1, 1)):
        a, b = (out[(r, rank, launch)]["records"] for rank in (0, 1))
        assert [(x["position"], x["committed"], x["participants"]) for x in a] == \
            [(x["position"], x["committed"], x["participants"]) for x in b]
    # Replica 0: a step it could not finish is not committed and is retried
    # at the same data position alone; it trains alone, then with the rejoined
    # replica.
    failed = [i for i, rec in enumerate(survivor) if not rec["committed"]]
    assert failed, "the step the dead replica was part of committed"
    after = survivor[failed[-1] + 1]
    assert after["committed"] and after["position"] == survivor[failed[-1]]["position"]
    assert after["participants"] == 1
    assert survivor[-1]["participants"] == 2 and survivor[-1]["step"] > END
    # The restarted replica was healed to replica 0's step and data position.
    rejoined = out[(1, 0, 1)]["records"]
    assert rejoined[0]["position"] == survivor[-1]["position"] and \
        rejoined[0]["step"] == survivor[-1]["step"]
    # Every committed step equals one process on the participants' batches.
    want = _reference(_history(out), tokens)
    for (replica, rank, launch), data in out.items():
        for rec in data["records"]:
            if rec["committed"]:
                assert rec["loss"] == pytest.approx(want[rec["step"]][0], rel=RTOL, abs=ATOL), \
                    (replica, launch, rec)
        assert data["grads"], f"replica {replica} rank {rank} committed no step"
        for step, grads in data["grads"].items():
            assert grads, f"rank {rank} holds no gradient at step {step}"
            for name, g in grads.items():
                torch.testing.assert_close(g, want[step][1][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} {name}: {m}")
    for rank in (0, 1):
        held = out[(0, rank, 0)]
        # The healed replica equals the survivor bitwise: parameters and optimizer.
        healed = out[(1, rank, 1)]
        for name, p in held["params"].items():
            assert torch.equal(p, healed["params"][name]), name
        for i, s in held["opt"]["state"].items():
            for k, v in s.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(healed["opt"]["state"][i][k]))


@pytest.mark.parametrize("fault,tokens", [("kill", True), ("stall", False)])
def test_a_replica_survives_its_peers_failure_and_heals_it_exactly(tmp_path, fault, tokens):
    env = {"QUORUM_KILL": "5:1"} if fault == "kill" else {"QUORUM_STALL": "5:1"}
    out = _run(tmp_path, env, tokens)
    assert not list(tmp_path.glob("replica0_*_1.pt")), "replica 0 was restarted"
    _check(out, tokens)


def test_bad_arguments_are_named_before_any_communication():
    pipe = mpmd.pipeline(qw.model(), loss_fn=qw.mean_loss, num_microbatches=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="replica_id=-1"):
        mpmd.ReplicaQuorum(pipe, opt, replica_id=-1, lighthouse="http://x:1")
    with pytest.raises(ValueError, match="min_replicas=0"):
        mpmd.ReplicaQuorum(pipe, opt, replica_id=0, lighthouse="http://x:1", min_replicas=0)
    with pytest.raises(ValueError, match=r"state\['data'\]=int"):
        mpmd.ReplicaQuorum(pipe, opt, replica_id=0, lighthouse="http://x:1", state={"data": 3})
    env = os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    try:
        with pytest.raises(ValueError, match="Lighthouse's address"):
            mpmd.ReplicaQuorum(pipe, opt, replica_id=0)
    finally:
        if env is not None:
            os.environ["TORCHFT_LIGHTHOUSE"] = env
    with pytest.raises(ValueError, match="dist.init_process_group"):
        mpmd.ReplicaQuorum(pipe, opt, replica_id=0, lighthouse="http://x:1",
                           timeout=datetime.timedelta(seconds=1))
