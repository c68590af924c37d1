"""One replica of tests/test_quorum.py: a 2-rank pipeline (torchrun job) in a
torchft quorum of replicas (torch_mpmd/parallel/quorum.py).

Environment: ``QUORUM_OUT`` (a folder), ``REPLICA`` (its number),
``TORCHFT_LIGHTHOUSE``, ``QUORUM_END`` (stop at the first committed step at
or past it that both replicas took part in), ``QUORUM_KILL`` ("STEP:RANK":
in the job's first launch that rank SIGKILLs itself once it has joined that
step's quorum, writing the time to ``fault_at``), ``QUORUM_STALL`` (the
same, hanging instead of dying), ``QUORUM_TOKENS``
("1": a token-weighted loss), ``QUORUM_SHARD`` ("1": each replica is
pp2 x dp2 with ``data_parallel="shard"``, 4 ranks), ``QUORUM_CLIP`` (the
quorum's ``max_norm``), ``QUORUM_TIMEOUT`` (seconds, default 10: the
pipeline's and the quorum's), ``QUORUM_SPLIT`` (the split point, default
"blocks.2"), ``QUORUM_REJOIN_AFTER`` (seconds a relaunched rank waits before
it starts: the tests' interpreters are forked, NOTE [Forked interpreters],
and start at once, where a real one spends seconds importing torch, in which
the surviving replica trains alone: the case the tests check).

The batch of replica r's dp rank k at data position d is a function of (r, k,
d); the data
position is a :class:`Cursor` healed with the model and advanced only by a
committed step. Each rank writes ``rank{R}_{launch}.pt``: every step's record
(data position, participants, committed, loss), the held parameters' grads
(whole, gathered over dp) at every committed step, and its final parameters
and optimizer state (this rank's rows).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torch_mpmd as mpmd
from models import MLP

D = 16


class Cursor:
    """The data position: batches consumed by committed steps."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def batch(replica: int, position: int, dp: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch of replica ``replica``'s dp rank ``dp`` at ``position``:
    inputs, targets, and a mask of the counted rows (a different count per
    batch)."""
    g = torch.Generator().manual_seed(1000 * replica + 100 * dp + position)
    x = torch.randn(8, D, generator=g)
    y = torch.randn(8, 4, generator=g)
    keep = torch.ones(8)
    keep[: (replica + dp + position) % 4] = 0.0
    return x, y, keep


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole (a DTensor gathered over the job's dp ranks)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rows(t: object) -> object:
    """This rank's part of ``t`` as a plain tensor (loadable without a mesh)."""
    if isinstance(t, DTensor):
        return t.to_local().detach().clone()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def token_loss(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    y, keep = target
    per_row = ((out - y) ** 2).mean(dim=1)
    return (per_row * keep).sum(), keep.sum()


def model() -> MLP:
    torch.manual_seed(0)
    return MLP(d=D, depth=4, markers=False)


def _trigger(name: str, step: int, rank: int) -> bool:
    spec = os.environ.get(name, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    at, who = (int(v) for v in spec.split(":"))
    return at == step and who == rank


def main() -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        time.sleep(float(os.environ.get("QUORUM_REJOIN_AFTER", "0")))
    started = time.time()  # after the imports
    out = os.environ["QUORUM_OUT"]
    replica = int(os.environ["REPLICA"])
    end = int(os.environ["QUORUM_END"])
    tokens = os.environ.get("QUORUM_TOKENS") == "1"
    timeout = float(os.environ.get("QUORUM_TIMEOUT", "10"))
    mpmd.init_process_group("gloo")
    layout: dict = {}
    dp = 0
    if os.environ.get("QUORUM_SHARD") == "1":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        layout = dict(mesh=mesh, data_parallel="shard")
        dp = mesh.get_local_rank("dp")
    pipe = mpmd.pipeline(model(), loss_fn=token_loss if tokens else mean_loss,
                         schedule="1f1b", num_microbatches=2,
                         split_points=[os.environ.get("QUORUM_SPLIT", "blocks.2")],
                         timeout=timeout, **layout)
    rank = dist.get_rank()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    cursor = Cursor()
    quorum = mpmd.ReplicaQuorum(pipe, opt, replica_id=replica,
                                timeout=datetime.timedelta(seconds=timeout),
                                # a slow start on a loaded machine is no fault
                                quorum_timeout=datetime.timedelta(seconds=60),
                                state={"data": cursor}, start_replicas=2,
                                max_norm=float(os.environ["QUORUM_CLIP"])
                                if os.environ.get("QUORUM_CLIP") else None)
    ready = time.time()
    launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    records: list[dict] = []
    grads: dict[int, dict[str, torch.Tensor]] = {}
    while True:
        t0 = time.time()
        quorum.join()  # a heal moves the cursor: the batch is drawn after it
        for name in ("QUORUM_KILL", "QUORUM_STALL"):
            if _trigger(name, quorum.step_count, rank):
                with open(os.path.join(out, "fault_at"), "w") as f:
                    f.write(f"{time.time():.6f}")
                if name == "QUORUM_KILL":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # stuck (until torchrun ends the replica)
        x, y, keep = batch(replica, cursor.position, dp)
        position = cursor.position
        done = quorum.step(x, target=(y, keep) if tokens else y)
        records.append(dict(position=position, participants=done.participants,
                            committed=done.committed, loss=float(done.loss), step=done.step,
                            grad_norm=done.grad_norm,
                            started=t0, ended=time.time()))
        if done.committed:
            for n, p in pipe.named_parameters():  # a held parameter must have one
                assert p.grad is not None, f"rank {rank}: {n} has no gradient"
            grads[done.step] = {n: _whole(p.grad) for n, p in pipe.named_parameters()}
            cursor.position += 1
        state = opt.state_dict()
        state["state"] = {i: {k: _rows(v) for k, v in s.items()}
                          for i, s in state["state"].items()}
        torch.save(dict(records=records, grads=grads, replica=replica, rank=rank, dp=dp,
                        params={n: _rows(p) for n, p in pipe.named_parameters()},
                        opt=state, started=started, ready=ready),
                   os.path.join(out, f"replica{replica}_rank{rank}_{launch}.pt"))
        if done.committed and done.step >= end and done.participants >= 2:
            break
        if done.participants < 2 and done.step >= end:
            time.sleep(0.2)  # alone past the end: wait for the peer without many steps
    quorum.shutdown()


# A relaunched replica starts this long after torchrun restarts it, as a
# fresh interpreter importing torch on a loaded machine would (or later).
REJOIN_AFTER_S = 5.0


def launch_quorum(out: Path, fault: dict[str, str], tokens: bool, end: int,
                  heartbeat_ms: int, restarts: int = 1, timeout_s: float = 300,
                  shard: bool = False, clip: float | None = None
                  ) -> tuple[list[int], dict[int, str]]:
    """Run the two replicas (``fault``: the environment of replica 1, e.g.
    ``{"QUORUM_KILL": "5:1"}``), each a torchrun job allowed ``restarts``
    (``shard``: 4 ranks each, pp2 x dp2 sharded), in a Lighthouse of this
    process. Returns the jobs' exit codes and log tails."""
    from torchft._torchft import LighthouseServer

    import dist_harness as H
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=heartbeat_ms,
                                  quorum_tick_ms=50, heartbeat_timeout_ms=heartbeat_ms)
    common = {"QUORUM_REJOIN_AFTER": str(REJOIN_AFTER_S),
              **({"QUORUM_TOKENS": "1"} if tokens else {}),
              **({"QUORUM_SHARD": "1"} if shard else {}),
              **({"QUORUM_CLIP": str(clip)} if clip is not None else {})}
    jobs: list[subprocess.Popen] = []
    try:
        for replica, env in ((0, common), (1, {**common, **fault})):
            # torchrun and its workers forked from the tests' zygote (NOTE
            # [Forked interpreters]): real processes, without the imports.
            python, prefix, env = H.launcher(dict(
                TORCHFT_LIGHTHOUSE=lighthouse.address(), QUORUM_OUT=str(out),
                REPLICA=str(replica), QUORUM_END=str(end), **env))
            cmd = [*python, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc(shard)), "--max-restarts", str(restarts),
                   *prefix, __file__]
            with open(out / f"replica{replica}.log", "w") as log:
                jobs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + timeout_s
        for job in jobs:
            job.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for job in jobs:  # torchrun ends its workers on SIGTERM (they are in their own sessions)
            if job.poll() is None:
                job.terminate()
                try:
                    job.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    job.kill()
        lighthouse.shutdown()
    return ([job.returncode for job in jobs],
            {r: (out / f"replica{r}.log").read_text() for r in (0, 1)})


def nproc(shard: bool) -> int:
    """Ranks per replica."""
    return 4 if shard else 2


def run_quorum(out: Path, fault: dict[str, str], tokens: bool, end: int,
               heartbeat_ms: int, shard: bool = False, clip: float | None = None) -> dict:
    """:func:`launch_quorum` where both jobs must succeed, replica 1 after one
    restart. Returns (replica, rank, launch) -> what that rank wrote."""
    codes, logs = launch_quorum(out, fault, tokens, end, heartbeat_ms, shard=shard, clip=clip)
    ranks = range(nproc(shard))
    tails = {r: text[-1500:] for r, text in logs.items()}
    assert codes == [0, 0], tails
    wrote = sorted(p.name for p in out.glob("replica*.pt"))
    assert wrote == sorted(f"replica{r}_rank{rank}_{launch}.pt" for r, launch in
                           ((0, 0), (1, 0), (1, 1)) for rank in ranks), (wrote, tails)
    return {(r, rank, launch): torch.load(out / f"replica{r}_rank{rank}_{launch}.pt",
                                          weights_only=False)
            for r, launch in ((0, 0), (1, 0), (1, 1)) for rank in ranks}


if __name__ == "__main__":
    main()
