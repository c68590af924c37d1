"""Every collective of torch_mpmd is bounded and names the rank that did not come.

1. The source: no torch.distributed collective or point-to-point call, DCP
   save/load, group creation or DTensor communication outside the bounded
   modules (parallel/lockstep.py and the modules it is made of), but for the
   calls of ALLOWED, each with the reason it is bounded. Read with ast, with
   each module's import aliases resolved (``dist.all_reduce``,
   ``torch.distributed.barrier``, ``from torch.distributed import send``).
2. The phases: rank 1 of two is killed in a checkpoint save (before it, and
   inside DCP's write), in ``replan()`` and in meta-device materialization;
   rank 0 raises CheckpointError / PipelineError naming rank 1 within the
   library's ``timeout=`` (the process group's own timeout is 600 s: only the
   library's bound can end the wait). Planning and checkpoint load are
   covered by tests/test_lockstep_bounds.py and tests/test_checkpoint_atomic.py.
   The save launch also checks that ``checkpoint.save`` leaves the optimizer
   as it was, before and after the first step (the optimizer holds both
   ranks' parameters: it was built before the first step).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import sys

from dist_harness import run_ranks

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torch_mpmd"

# The bounded path itself: the collectives issued here carry the timeout as
# their own and are waited for by a wait that names the missing rank.
BOUNDED = {"parallel/lockstep.py", "parallel/bounded.py", "parallel/named_waits.py",
           "parallel/job_store.py"}

_DIST = "torch.distributed"
COLLECTIVES = {f"{_DIST}.{n}" for n in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "init_process_group", "destroy_process_group")} | {
    f"{_DIST}.checkpoint.{n}" for n in ("save", "load", "async_save", "save_state_dict",
                                        "load_state_dict")} | {
    f"{_DIST}.device_mesh.init_device_mesh", f"{_DIST}.tensor.distribute_module"}
# Methods of a ProcessGroup (c10d's own names, no other object has them) and
# DTensor methods that communicate.
METHODS = {"allreduce", "allgather", "_allgather_base", "allgather_coalesced",
           "allreduce_coalesced", "alltoall", "alltoall_base", "_reduce_scatter_base",
           "reduce_scatter_tensor_coalesced", "full_tensor", "redistribute"}

# (module, call) -> (how many, why it is bounded).
ALLOWED = {
    ("runtime/outputs.py", f"{_DIST}.isend"): (
        1, "a model output to the output rank, waited for by RankRuntime.wait (bounded by "
           "the pipeline's timeout, names the peer)"),
    ("runtime/outputs.py", f"{_DIST}.irecv"): (1, "the other side of the isend above"),
    ("checkpoint/sync.py", f"{_DIST}.new_group"): (
        1, "the checkpoint's gloo group, made only after every rank arrived "
           "(Collectives.arrive names a missing one), its timeout the checkpoint's"),
    ("checkpoint/saving.py", f"{_DIST}.checkpoint.save"): (
        1, "inside Sync.run_dcp: every rank arrived first, DCP's collectives run on the "
           "checkpoint's group whose timeout is the checkpoint's; a failure names the rank"),
    ("checkpoint/loading.py", f"{_DIST}.checkpoint.load"): (1, "as dcp.save above"),
    ("parallel/sharding.py", "._allgather_base"): (
        1, "ZeRO's parameter all-gather: carries the pipeline's timeout as its own "
           "(opts.timeout, NOTE [Bounded collectives]) and is waited for by the runtime's wait"),
    ("parallel/sharding.py", "._reduce_scatter_base"): (
        1, "ZeRO's gradient reduce-scatter, bounded as the all-gather above"),
    ("parallel/data_parallel.py", f"{_DIST}.new_group"): (
        3, "groups of the replicas, made while the pipeline is built, after its start-up "
           "handshake (every rank arrived); NOT bounded by the pipeline's timeout: "
           "new_group's own store barrier waits for the default group's timeout"),
    ("parallel/launch.py", f"{_DIST}.init_process_group"): (
        2, "the default group itself, made at the user's call (with or without torchrun's "
           "agent store), bounded by its timeout argument"),
    ("parallel/quorum.py", ".allreduce"): (
        2, "torchft's Manager.allreduce over the replicas: its process group carries the "
           "quorum's timeout, and a failure is reported to the quorum (the step does not "
           "commit), not raised"),
}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """{local name: what it names} for the torch imports of a module."""
    out = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _communicates(call: ast.Call, name: str) -> bool:
    """Calls that communicate only with some arguments: distribute_tensor
    (not with ``src_data_rank=None``), DTensor.from_local (not with
    ``run_check=False``)."""
    kwargs = {k.arg: k.value for k in call.keywords}

    def is_const(key: str, value: object) -> bool:
        v = kwargs.get(key)
        return isinstance(v, ast.Constant) and v.value is value

    if name.endswith("distribute_tensor"):
        return not is_const("src_data_rank", None)
    if name.endswith(".from_local"):
        return not is_const("run_check", False)
    return True


def raw_collectives() -> dict[tuple[str, str], list[int]]:
    """(module, call) -> the lines of every raw collective outside BOUNDED."""
    found: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in BOUNDED:
            continue
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func)
            if dotted is None:
                if isinstance(node.func, ast.Attribute) and node.func.attr in METHODS:
                    found[(rel, f".{node.func.attr}")].append(node.lineno)
                continue
            head, _, rest = dotted.partition(".")
            name = aliases.get(head, head) + (f".{rest}" if rest else "")
            attr = dotted.rpartition(".")[2]
            if name in COLLECTIVES or (name.startswith(f"{_DIST}.") and attr in (
                    "distribute_tensor", "from_local") and _communicates(node, name)):
                found[(rel, name)].append(node.lineno)
            elif "." in dotted and attr in METHODS:
                found[(rel, f".{attr}")].append(node.lineno)
            elif attr == "from_local" and _communicates(node, name):
                found[(rel, ".from_local")].append(node.lineno)
    return found


def test_the_scan_finds_raw_collectives_in_every_spelling(tmp_path, monkeypatch):
    src = tmp_path / "torch_mpmd" / "m.py"
    src.parent.mkdir()
    src.write_text(
        "import torch\nimport torch.distributed as dist\nimport torch.distributed as d2\n"
        "from torch.distributed import barrier as b\nimport torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.tensor import distribute_tensor, DTensor\n"
        "dist.all_reduce(x)\nd2.broadcast_object_list(y)\ntorch.distributed.send(t, 1)\nb()\n"
        "dcp.save(s)\ngroup.allgather([o], [t], opts)\nt.full_tensor()\n"
        "distribute_tensor(v, m, p)\ndistribute_tensor(v, m, p, src_data_rank=None)\n"
        "DTensor.from_local(v, m, p)\nDTensor.from_local(v, m, p, run_check=False)\n"
        "dist.get_rank()\nwaits.barrier('x')\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", src.parent)
    found = {call: lines for (_, call), lines in raw_collectives().items()}
    assert found == {
        f"{_DIST}.all_reduce": [7], f"{_DIST}.broadcast_object_list": [8],
        f"{_DIST}.send": [9], f"{_DIST}.barrier": [10], f"{_DIST}.checkpoint.save": [11],
        ".allgather": [12], ".full_tensor": [13], f"{_DIST}.tensor.distribute_tensor": [14],
        f"{_DIST}.tensor.DTensor.from_local": [16]}, found


def test_no_raw_collective_outside_the_bounded_modules():
    found = raw_collectives()
    new = {key: lines for key, lines in found.items()
           if key not in ALLOWED or len(lines) > ALLOWED[key][0]}
    assert not new, ("raw collectives outside " + ", ".join(sorted(BOUNDED)) + " (use "
                     "lockstep.Collectives / lockstep.all_reduce / broadcast / wait, or add "
                     "an entry to ALLOWED saying why it is bounded): " +
                     "; ".join(f"{m}:{lines} {call}" for (m, call), lines in sorted(new.items())))
    gone = [key for key in ALLOWED if key not in found]
    assert not gone, f"ALLOWED entries that match nothing any more (remove them): {gone}"


# ------------------------------------------------------------------ a peer killed

TIMEOUT_S = 10.0


def _killed_in(phase, tmp_path):
    run = run_ranks(2, "bounded_collectives_worker:peer_dies", phase, str(tmp_path), TIMEOUT_S,
                    timeout=240, pg_timeout=600, failure_grace=90, check=False)
    got = run.results[0]
    assert run.complete[0] and got and got.get("type"), run.describe([0, 1])
    assert got["raised_after"] < TIMEOUT_S + 30, got   # not the process group's 600 s
    return run, got


def test_a_rank_killed_before_a_checkpoint_save_is_named_and_save_left_the_optimizer_alone(
        tmp_path):
    # Before: save hung past the process group's timeout (measured > 100 s
    # with timeout=15); and save trimmed an optimizer built before the first
    # step to this rank's parameters.
    run, got = _killed_in("save", tmp_path)
    assert got["type"] == "CheckpointError", got
    assert re.search(r"^saving a checkpoint under .*rank 1 (never arrived|has not arrived|"
                     r"died|closed its connection)", got["message"]), got["message"]
    assert not got["latest written"], got
    for rank, r in enumerate(run.results):
        opt = r["optimizer"]
        assert opt["before the first step"] == [], (rank, opt)
        assert opt["after the first step"] == [], (rank, opt)
        for when in ("before the first step", "after the first step"):
            saved, never = opt[f"loss {when}"]
            assert saved == never, (rank, when, saved, never)
        assert opt["params differ"] == [] and opt["optimizer differs"] == [], (rank, opt)
        assert opt["groups"] == [opt["params"]], (rank, opt)   # every parameter kept


def test_a_rank_dying_inside_dcps_save_is_named(tmp_path):
    _, got = _killed_in("save_in_dcp", tmp_path)
    assert got["type"] == "CheckpointError", got
    assert re.search(r"^saving .* failed on rank 0: .*rank 1 (closed its connection|died|"
                     r"never arrived|has not arrived)", got["message"]), got["message"]
    assert not got["latest written"], got


def test_a_rank_killed_before_replan_is_named(tmp_path):
    _, got = _killed_in("replan", tmp_path)
    assert got["type"] == "PipelineError", got
    assert got["peer"] == 1, got
    assert re.search(r"^rank 0: replan: waiting for the other ranks at the stage times.*"
                     r"rank 1 (never arrived|has not arrived|died)", got["message"],
                     re.S), got["message"]


def test_a_rank_killed_while_materializing_a_meta_model_is_named(tmp_path):
    _, got = _killed_in("meta_init", tmp_path)
    assert got["type"] == "PipelineError", got
    assert re.search(r"^rank 0: materializing the meta model: waiting for the other ranks at "
                     r"the broadcast of the materialized tied parameters .*rank 1 "
                     r"(never arrived|died)", got["message"], re.S), got["message"]


def test_a_rank_killed_before_a_meshs_groups_are_made_is_named(tmp_path):
    # Before: new_group's rendezvous waited out the process group's timeout.
    _, got = _killed_in("mesh_groups", tmp_path)
    assert got["type"] == "PipelineError", got
    assert re.search(r"^rank 0: the one-rank pipeline groups of a mesh without 'pp': .*"
                     r"1 of the 2 ranks arrived", got["message"], re.S), got["message"]
