"""Sharded data parallel (ZeRO-3) of a pipeline's stages over the "dp" mesh dimension.

With ``pipeline(..., mesh=mesh, data_parallel="shard")`` every parameter is
split along dim 0 over the dp ranks, as torch's FSDP2 does: the user sees a
DTensor ``Parameter`` with placement ``Shard(0)`` (0-dim parameters:
``Replicate()``) under the module's own FQN, builds the optimizer over those
and checkpoints them with DCP (which reshards them to any layout). The
stage graphs and programs keep reading the module's own full-shape
parameters, the *compute parameters*: between gathers they hold a stand-in
that owns no memory (meta_init's zero-stride expand), and the schedule's
actions give them their values:

    UNSHARD(s)     post the all-gather of stage s's shards (asynchronous)
    first compute  wait for it; each compute parameter takes its full value
    RESHARD(s)     compute parameters back to stand-ins, their full
                   storages emptied (NOTE [Resharding frees the storage])
    REDUCE_GRAD(s) reduce-scatter of the stage's full gradients, averaged
                   over dp, into the shards' DTensor gradients (async; the
                   step waits for them at its end)

NOTE [Why not fully_shard]: FSDP2 gathers in a module forward pre-hook and
reduces in autograd post-backward hooks. The stage programs (programs/stage_programs.py) take
parameters as inputs and run with no autograd engine, so neither hook fires;
and the schedule, not the module call order, knows when a stage runs next.
The collectives are therefore the executor's actions, and this module does
what FSDP2's hooks would: flat per-stage buffers, one all-gather and one
reduce-scatter per stage, the same dim-0 layout (``torch.chunk`` sizes) so
the DTensors are exactly FSDP2's.

NOTE [Lazy gather]: a compute action of a stage whose parameters are not
gathered gathers them at once (synchronously). The executors that run part of
a schedule (forward-only inference, eval) carry no UNSHARD actions and rely on
it; every replica of a pipeline rank runs the same program, so their gathers
pair up. The runtime gathers every local stage before such a run starts, so
that a rank whose compute fails (its executor then skips the rest) has posted
the gathers its replicas wait for. After every executor run, whatever is
still gathered is resharded.

NOTE [Sharding with tensor parallel]: with a "tp" mesh dim the compute
parameters of tensor-parallel layers are DTensors over "tp"; what a rank
computes with is their local shard, and that is what is split over "dp",
along the first dim the tensor-parallel placement leaves whole (a column-
parallel weight, Shard(0) over "tp", is split along dim 1 over "dp"). The
user's parameter is then a DTensor over the ("dp", "tp") mesh with
placements (Shard(d), <its tp placement>): plain DTensor layouts, which DCP
reshards to any other. A tensor whose every dim the tp placement splits (a
column-parallel bias) is replicated over "dp", its gradient all-reduced.

A parameter read by two stages of this rank (tied weights, V schedules) is
gathered by each stage's UNSHARD and stays full until both have resharded; its
gradient is reduced once, at the later stage's REDUCE_GRAD.

NOTE [Resharding frees the storage]: setting a compute parameter's ``.data``
back to a stand-in frees nothing while other tensors view its full value,
and the forwards keep such views for their backwards: a stage program's F
returns the parameters it reads among its ``saved`` outputs (the Parameter
objects themselves, which follow ``.data``, but also new tensors viewing them:
the transposed weight of every linear, ``aten.t`` / ``permute``, FX and
Inductor alike), and under autograd the graph saves the same views (addmm's
``mat2``). With ``reshard_after_forward`` those views kept most of a
stage's gathered bytes (86-95% in the tests and BENCHMARKS.md) alive from
its RESHARD to its backward. So, as FSDP2
does, each compute parameter owns one full-size tensor for as long as the
pipeline lives: a gather allocates its storage again (``resize_``) and copies
the gathered rows into it, RESHARD empties it in place
(``untyped_storage().resize_(0)``). The storage object stays the same, so a
view saved by a forward reads the values the next gather writes (the same
values: the parameters change only at the optimizer step, after the step's
last backward) and holds no memory in between. The parameter itself still
becomes a stand-in at RESHARD (other code tells gathered from not by it).
The copies write the full tensor, never the parameter, so the parameter's
version counter, which autograd checks for the tensors it saved, is left as
it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torch_mpmd.parallel import lockstep
from torch_mpmd.parallel.meta_init import is_standin

__all__ = ["ParamShards", "ShardedStages", "DATA_PARALLEL_MODES", "local_grad",
           "set_local_grad", "shard_rows"]

DATA_PARALLEL_MODES = ("replicate", "shard")


def _standin(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def _empty_like_layout(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, strides, dtype and device owning no memory
    (its storage emptied): NOTE [Parked parameters]."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.untyped_storage().resize_(0)
    return out


def _rows(d0: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that dp rank ``rank`` holds: torch.chunk's
    split (chunks of ceil(d0/size) rows, the last ones short or empty), which
    is DTensor's Shard(0) layout."""
    c = -(-d0 // size)
    start = min(rank * c, d0)
    return start, min(start + c, d0)


def _base(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank computes with for parameter ``p``: a tensor-parallel
    DTensor's local shard (what the stage programs read), else ``p``."""
    return p._local_tensor if isinstance(p, DTensor) else p


def _set_base(p: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(p, DTensor):
        p._local_tensor.data = value
    else:
        p.data = value


def _shard_dim(p: torch.Tensor) -> int | None:
    """The dim of ``p`` split over "dp": 0, or for a tensor-parallel DTensor the
    first dim its own placements do not split (NOTE [Sharding with tensor
    parallel]); None: ``p`` is replicated over "dp" (0-dim, or every dim taken)."""
    base = _base(p)
    taken = ({pl.dim for pl in p.placements if isinstance(pl, Shard)}
             if isinstance(p, DTensor) else set())
    return next((d for d in range(base.dim()) if d not in taken), None)


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """Where the buffers of the all-gathers and reduce-scatters live: on
    ``device``, or on the CPU when gloo carries that device's tensors (gloo
    reads host memory: a CUDA all-gather over gloo crashed the process on an
    H200, NOTE [Host staging] in csrc/runtime/c10d_transport.h)."""
    if device.type in ("cpu", "meta"):
        return device
    name = backend_for(str(dist.get_backend(group)), device.type)
    return torch.device("cpu") if name in (None, "gloo") else device


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a group's name gives ``device_type`` tensors: "gloo" for
    "gloo", "nccl" for "cpu:gloo,cuda:nccl" and "cuda"; None when a per-device
    name lists no backend for it."""
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return per_device.get(device_type) if per_device else backend


def shard_rows(shards: "ParamShards", p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, a value shaped like compute parameter
    ``p``'s local tensor (a gradient): the rows its shard holds (the whole of
    it for a parameter replicated over "dp")."""
    d = _shard_dim(p)
    if d is None:
        return full
    start, stop = _rows(full.shape[d], shards.size, shards.rank)
    return full.narrow(d, start, stop - start)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``p`` as this rank holds it (a DTensor's local shard)."""
    g = p.grad
    return g._local_tensor if isinstance(g, DTensor) else g


def set_local_grad(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.grad`` = ``value`` (this rank's part of it, for a DTensor ``p``)."""
    if isinstance(p, DTensor):
        if isinstance(p.grad, DTensor):
            p.grad._local_tensor.copy_(value)
        else:
            p.grad = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
    else:
        p.grad = value


class ParamShards:
    """Every parameter of a module as a DTensor shard over ``mesh`` (1-D, "dp"),
    made when the pipeline is built. ``of[id(compute parameter)]`` is its
    shard; the compute parameters become stand-ins (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, mesh: Any, root: Any = None) -> None:
        self.mesh = mesh
        self.root = root  # the whole mesh: ("dp", "tp") sub-meshes for tensor parallel
        self._meshes: dict[str, Any] = {}
        self.group = mesh.get_group()
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.of: dict[int, torch.nn.Parameter] = {}
        self.compute: dict[int, torch.nn.Parameter] = {}  # id(shard) -> compute parameter
        # NOTE [Parked parameters]: (parameter, its empty look-alike) per plain
        # compute parameter that becomes a stand-in.
        self._parkable: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._parked_now: list[torch.nn.Parameter] = []
        for p in module.parameters():  # deduplicated: tied parameters share a shard
            shard = self._make(p)
            self.of[id(p)] = shard
            self.compute[id(shard)] = p
            # NOTE [One-element parameters]: a stand-in of one element (a
            # zero-stride view of a zero) cannot be told from a value
            # (meta_init.is_standin counts it as one), and it owns its element
            # anyway: these compute parameters keep their value, which take()
            # copies back at capture (a meta-device model's init_fn writes it).
            base = _base(p)
            if base.numel() > 1:
                if not isinstance(p, DTensor):
                    self._parkable.append((p, _empty_like_layout(p)))
                _set_base(p, _standin(base))

    # NOTE [Parked parameters]: torch.compile guards the tensors a compiled
    # function reads, its module's parameters among them, by shape and strides.
    # Through the compile door (backend="mpmd") those parameters are the
    # compute parameters, whose stand-ins (zero strides) would fail the guards
    # that Dynamo made from their full values: a recompile on every call, and
    # none at all on the first ("guard failed on the same frame it was
    # created"). Between the door's calls they are therefore parked: each
    # holds a tensor of its own shape and strides whose storage is empty (no
    # memory, as a stand-in; its values must not be read: the values live in
    # the DTensor shards, ``pipeline_of(fn).parameters()``). A call unparks
    # them (stand-ins again, which the gathers recognise) before anything else.
    def park(self) -> None:
        """Compute parameters that are stand-ins take their parked look-alikes."""
        for p, parked in self._parkable:
            if is_standin(p):
                p.data = parked
                self._parked_now.append(p)

    def unpark(self) -> None:
        """Parked compute parameters become stand-ins again."""
        for p in self._parked_now:
            p.data = _standin(p)
        self._parked_now.clear()

    def _mesh_for(self, p: torch.Tensor) -> Any:
        """The mesh of ``p``'s shard: "dp", or ("dp", its tp dim) for a DTensor."""
        if not isinstance(p, DTensor):
            return self.mesh
        names = p.device_mesh.mesh_dim_names or ()
        if self.root is None or len(names) != 1:
            raise ValueError(f"a DTensor parameter on mesh dims {names} cannot be sharded over "
                             "'dp': tensor-parallel parameters must live on the pipeline "
                             "mesh's 'tp' dim (parallelize_module(..., mesh['tp'], ...))")
        if names[0] not in self._meshes:
            self._meshes[names[0]] = self.root["dp", names[0]]
        return self._meshes[names[0]]

    def _make(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        base = _base(p)
        d = _shard_dim(p)
        if d is None:
            local, placement = base.detach().clone(), Replicate()
        else:
            start, stop = _rows(base.shape[d], self.size, self.rank)
            local, placement = base.detach().narrow(d, start, stop - start), Shard(d)
            # A meta-device model's stand-in stays one (materialized later).
            local = (_standin(local) if is_standin(base) else
                     local.clone(memory_format=torch.contiguous_format))
        placements = [placement, *(p.placements if isinstance(p, DTensor) else ())]
        dt = DTensor.from_local(local, self._mesh_for(p), placements, run_check=False,
                                shape=p.shape, stride=torch.empty(p.shape, device="meta").stride())
        return torch.nn.Parameter(dt, requires_grad=p.requires_grad)

    def shard_of(self, t: torch.Tensor) -> torch.Tensor:
        """The user's parameter for ``t`` (its shard; ``t`` itself for buffers)."""
        return self.of.get(id(t), t)

    def shard_value(self, shard: torch.Tensor, value: Any) -> Any:
        """``value`` for loading into the DTensor ``shard``: a full plain tensor
        becomes a DTensor of this rank's part, cut locally (anything else is
        returned as is, for load_state_dict to judge)."""
        if not isinstance(shard, DTensor) or isinstance(value, DTensor) or \
                not isinstance(value, torch.Tensor) or value.shape != shard.shape:
            return value
        value = value.detach().to(device=shard._local_tensor.device, dtype=shard.dtype)
        return distribute_tensor(value, shard.device_mesh, shard.placements, src_data_rank=None)

    def take(self, params: Iterable[torch.Tensor]) -> None:
        """Compute parameters that hold full values (materialized, or loaded):
        copy this rank's rows into their shards and free them. Parameters of
        one element or none hold their value (NOTE [One-element parameters]):
        copied too."""
        with torch.no_grad():
            for p in params:
                shard = self.of.get(id(p))
                base = _base(p)
                if shard is None or is_standin(base):
                    continue
                local = shard._local_tensor
                d = _shard_dim(p)
                if d is None:  # a replica: the whole value
                    src = base.detach()
                else:
                    start, stop = _rows(base.shape[d], self.size, self.rank)
                    src = base.detach().narrow(d, start, stop - start)
                if is_standin(local) or local.shape != src.shape:
                    local.data = src.clone(memory_format=torch.contiguous_format)
                else:
                    local.copy_(src)
                if base.numel() > 1:
                    _set_base(p, _standin(base))

    def release(self, keep: Iterable[torch.Tensor]) -> None:
        """Free the shards of every parameter not in ``keep`` (compute
        parameters of this rank's stages): other ranks' stages never run here."""
        kept = {id(p) for p in keep}
        for pid, shard in self.of.items():
            local = shard._local_tensor
            if pid not in kept and not is_standin(local) and local.numel() > 1:
                local.data = _standin(local)


@dataclass
class _Slot:
    """One parameter's place in a stage's flat buffers. Its "rows" are the
    slices along ``dim``, the dim split over "dp", of what the rank computes
    with (the full parameter, or a tensor-parallel local shard)."""
    param: torch.nn.Parameter  # compute parameter
    shard: torch.nn.Parameter  # its DTensor shard
    dim: int                   # the dim split over "dp"
    rows: int                  # its size
    row_numel: int             # elements per row
    chunk: int                 # rows per rank, padded (ceil(rows / dp))
    offset: int                # in this rank's flat shard

    def moved(self, rows: int) -> list[int]:
        """The shape of ``rows`` rows with ``dim`` moved first."""
        shape = list(_base(self.param).shape)
        return [rows] + shape[:self.dim] + shape[self.dim + 1:]

    @property
    def numel(self) -> int:
        return self.chunk * self.row_numel


def _layout(params: Sequence[torch.nn.Parameter], shards: ParamShards
            ) -> tuple[list[_Slot], list[torch.nn.Parameter], int]:
    """(slots of the dim-0 sharded parameters, the replicated 0-dim ones, flat numel)."""
    slots, replicated, offset = [], [], 0
    for p in params:
        d = _shard_dim(p)
        if d is None:
            replicated.append(p)
            continue
        base = _base(p)
        rows = base.shape[d]
        slot = _Slot(p, shards.of[id(p)], d, rows, base.numel() // rows if rows else 0,
                     -(-rows // shards.size), offset)
        slots.append(slot)
        offset += slot.numel
    return slots, replicated, offset


_Bucket = tuple[list[_Slot], list[torch.nn.Parameter], int]


def _buckets(params: Sequence[torch.nn.Parameter], shards: ParamShards) -> list[_Bucket]:
    """The parameters' flat layouts, one per dtype (a flat buffer has one
    dtype: a stage mixing fp32 and bf16 parameters gathers and reduces each
    kind on its own), in the order the dtypes first appear."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(_base(p).dtype, []).append(p)
    return [_layout(ps, shards) for ps in by_dtype.values()]


class ShardedStages:
    """UNSHARD, RESHARD and REDUCE_GRAD of one rank's stages (the module docstring).

    ``stage_params``: per local stage, the compute parameters it reads;
    ``reduce_order``: the stages in the order of their REDUCE_GRAD actions
    (a parameter several stages read is reduced at the last of them);
    ``wait(work, what)`` waits for a collective within the pipeline timeout;
    ``reduced_elsewhere``: ids of compute parameters whose gradients another
    reduction takes (tied weights across pipeline ranks: tied.py).
    """

    def __init__(self, shards: ParamShards, stage_params: Mapping[int, Sequence[torch.nn.Parameter]],
                 reduce_order: Sequence[int], timeout_s: float,
                 wait: Callable[[Any, str], None],
                 reduced_elsewhere: Iterable[int] = ()) -> None:
        self.shards = shards
        self.group = shards.group
        self.size = shards.size
        self.timeout_s = timeout_s
        self.wait = wait
        self.ranks = dist.get_process_group_ranks(self.group)
        first = next((p for ps in stage_params.values() for p in ps), None)
        self.comm_device = _comm_device(self.group, _base(first).device if first is not None
                                        else torch.device("cpu"))
        self.gather = {s: _buckets(ps, shards) for s, ps in stage_params.items()}
        owner: dict[int, int] = {}
        by_id: dict[int, torch.nn.Parameter] = {}
        elsewhere = set(reduced_elsewhere)
        # Every parameter the stages compute a gradient for: the module's
        # requires_grad, fixed per capture (NOTE [Freezing] in session.py). A
        # frozen shard is reduced too and left without gradient (add_grad), so
        # the user can freeze and unfreeze shards without a new capture.
        for s in list(stage_params) + list(reduce_order):  # the last REDUCE_GRAD wins
            for p in stage_params.get(s, ()):
                if id(p) in elsewhere:
                    continue
                if p.requires_grad:
                    owner[id(p)] = s
                    by_id[id(p)] = p
        self.reduce_layout = {s: _buckets([by_id[i] for i, o in owner.items() if o == s], shards)
                              for s in stage_params}
        # The full gradients the stages' backwards made and no REDUCE_GRAD has
        # taken yet: id(compute parameter) -> bytes (note_grads, live_bytes).
        self._grad_params = {s: [p for p in ps if id(p) in by_id] for s, ps in stage_params.items()}
        self._grads: dict[int, int] = {}
        self._grad_bytes = 0
        self._users: dict[int, int] = {}  # id(compute parameter) -> gathered stages using it
        # id(compute parameter) -> the tensor whose storage holds its full
        # value, emptied by RESHARD (NOTE [Resharding frees the storage]);
        # the bytes they hold now, and at most during this executor run.
        self._full: dict[int, torch.Tensor] = {}
        self._held = 0
        self._peak_held = 0
        self._gathered: set[int] = set()
        self._pending: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # per bucket
        self._reductions: list[tuple[Any, torch.Tensor, list[_Slot], list[torch.nn.Parameter]]] = []
        # This step's gathers, for report(): (posted, completed, waited) in
        # seconds of time.perf_counter, completion set by the work's future.
        self._timing: dict[int, list[float]] = {}
        self._gathers: list[tuple[float, float, float, int]] = []
        self._reduced_bytes = 0

    def _what(self, verb: str, stage: int) -> str:
        return (f"the {verb} of stage {stage}'s parameters over the data-parallel group "
                f"(global ranks {self.ranks})")

    # ------------------------------------------------------------ UNSHARD
    def unshard(self, stage: int) -> None:
        """Post the all-gather of the stage's shards (returns at once)."""
        if stage in self._gathered or stage in self._pending or stage not in self.gather:
            return
        posted = time.perf_counter()
        works = []
        for slots, _, numel in self.gather[stage]:
            if not slots:
                works.append((None, None))
                continue
            first = _base(slots[0].param)
            flat = torch.empty(numel, dtype=first.dtype, device=self.comm_device)
            for slot in slots:
                local = slot.shard._local_tensor.movedim(slot.dim, 0).reshape(-1)
                flat[slot.offset:slot.offset + local.numel()].copy_(local)
            out = flat.new_empty(self.size * numel)
            opts = torch._C._distributed_c10d.AllgatherOptions()
            opts.timeout = lockstep.as_timedelta(self.timeout_s)
            works.append((self.group._allgather_base(out, flat, opts), out))
        self._pending[stage] = works
        timing = self._timing[stage] = [posted, 0.0]
        last = next((w for w, _ in reversed(works) if w is not None), None)
        try:  # one group's works complete in order: the last one's completion
            if last is not None:
                last.get_future().then(lambda _f, t=timing: t.__setitem__(1, time.perf_counter()))
        except RuntimeError:  # a backend without futures: completion = end of the wait
            pass

    def ready(self, stage: int) -> None:
        """Before a compute action of the stage: its parameters hold full values
        (waits for the UNSHARD's gather, or gathers now: NOTE [Lazy gather])."""
        if stage in self._gathered or stage not in self.gather:
            return
        if stage not in self._pending:
            self.unshard(stage)
        works = self._pending.pop(stage)
        start = time.perf_counter()
        for work, _ in works:
            if work is not None:
                self.wait(work, self._what("all-gather", stage))
        end = time.perf_counter()
        posted, done = self._timing.pop(stage, (start, 0.0))
        done = min(done, end) if done else end
        self._gathers.append((posted, done, end - start,
                              sum(o.numel() * o.element_size() for _, o in works if o is not None)))
        with torch.no_grad():
            for (_, out), (slots, replicated, numel) in zip(works, self.gather[stage]):
                table = out.view(self.size, numel) if out is not None else None
                if slots and table.device != slots[0].shard._local_tensor.device:
                    table = table.to(slots[0].shard._local_tensor.device)  # host-staged: one copy
                for slot in slots:
                    if self._users.get(id(slot.param), 0) == 0:
                        self._unpack(table, slot)
                    self._users[id(slot.param)] = self._users.get(id(slot.param), 0) + 1
                for p in replicated:
                    if self._users.get(id(p), 0) == 0:
                        local = self.shards.of[id(p)]._local_tensor
                        _set_base(p, self._refill(p, local.device).copy_(local))
                    self._users[id(p)] = self._users.get(id(p), 0) + 1
        self._gathered.add(stage)
        if self._held > self._peak_held:
            self._peak_held = self._held

    def _unpack(self, table: torch.Tensor, slot: _Slot) -> None:
        """The slot's parameter takes its full value: row r of the gathered
        ``table`` holds dp rank r's rows, copied into the parameter's full
        storage along its sharded dim."""
        full = self._refill(slot.param, slot.shard._local_tensor.device)
        rows = full.movedim(slot.dim, 0)
        for r in range(self.size):
            start, stop = _rows(slot.rows, self.size, r)
            if stop > start:
                n = (stop - start) * slot.row_numel
                part = table[r, slot.offset:slot.offset + n]
                rows[start:stop].copy_(part.view(slot.moved(stop - start)))
        _set_base(slot.param, full)

    def _refill(self, p: torch.nn.Parameter, device: torch.device) -> torch.Tensor:
        """The tensor that holds compute parameter ``p``'s full value, its
        storage allocated again if a RESHARD emptied it (NOTE [Resharding
        frees the storage]); the caller writes the values."""
        full = self._full.get(id(p))
        if full is None:
            base = _base(p)
            full = self._full[id(p)] = torch.empty(base.shape, dtype=base.dtype, device=device)
        storage = full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(full.numel() * full.element_size())
        self._held += storage.nbytes()
        return full

    def _free(self, p: torch.nn.Parameter) -> None:
        """``p`` back to a stand-in, its full storage emptied in place: every
        tensor still viewing it (saved for backward) holds no memory until the
        next gather refills it."""
        _set_base(p, _standin(_base(p)))
        full = self._full.get(id(p))
        if full is not None:
            storage = full.untyped_storage()
            self._held -= storage.nbytes()
            storage.resize_(0)

    # ------------------------------------------------------------ RESHARD
    def reshard(self, stage: int) -> None:
        """Free the stage's full parameters (a gather still in flight is
        dropped: its work keeps its own buffers)."""
        self._pending.pop(stage, None)
        if stage not in self._gathered:
            return
        self._gathered.discard(stage)
        every = [p for slots, replicated, _ in self.gather[stage]
                 for p in [s.param for s in slots] + replicated]
        for p in every:
            n = self._users.get(id(p), 0) - 1
            self._users[id(p)] = n
            if n <= 0:
                self._free(p)

    def reshard_all(self) -> None:
        for stage in list(self._gathered) + list(self._pending):
            self.reshard(stage)

    # ------------------------------------------------------------ REDUCE_GRAD
    def reduce(self, stage: int) -> None:
        """Post the reduce-scatter of the stage's gradients (mean over dp); the
        compute parameters' full gradients are released."""
        for bucket in self.reduce_layout.get(stage, []):
            self._reduce(*bucket)

    def _reduce(self, slots: list[_Slot], replicated: list[torch.nn.Parameter],
                numel: int) -> None:
        if slots:
            p0 = _base(slots[0].param)  # the bucket's dtype (gradients take it)
            table = torch.zeros(self.size, numel, dtype=p0.dtype, device=self.comm_device)
            for slot in slots:
                g = local_grad(slot.param)
                if g is not None:  # rank r's rows go to row r of the table
                    g = g.movedim(slot.dim, 0).reshape(slot.rows, slot.row_numel)
                    for r in range(self.size):
                        start, stop = _rows(slot.rows, self.size, r)
                        n = (stop - start) * slot.row_numel
                        table[r, slot.offset:slot.offset + n].copy_(g[start:stop].reshape(-1))
                slot.param.grad = None
            self._taken(slot.param for slot in slots)
            table.div_(self.size)
            out = table.new_empty(numel)
            opts = torch._C._distributed_c10d.ReduceScatterOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            opts.timeout = lockstep.as_timedelta(self.timeout_s)
            work = self.group._reduce_scatter_base(out, table.view(-1), opts)
            self._reduced_bytes += table.numel() * table.element_size()
            self._reductions.append((work, out, slots, []))
        if replicated:
            grads = []
            for p in replicated:
                g = local_grad(p)
                grads.append(g.reshape(-1) if g is not None else
                             torch.zeros(_base(p).numel(), dtype=p.dtype, device=_base(p).device))
                p.grad = None
            self._taken(replicated)
            flat = torch.cat(grads).div_(self.size)
            work = lockstep.all_reduce(flat, self.group, self.timeout_s)
            self._reductions.append((work, flat, [], replicated))

    def begin_step(self) -> None:
        self._reductions = []
        self._reduced_bytes = 0
        self._grads.clear()  # (the last step's REDUCE_GRADs took them)
        self._grad_bytes = 0

    def begin_run(self) -> None:
        """An executor run starts: report() covers it alone."""
        self._gathers = []
        self._peak_held = self._held

    def note_grads(self, stage: int) -> None:
        """After a backward of ``stage`` (B, I or W): the full gradients its
        parameters hold now, for :meth:`live_bytes`."""
        for p in self._grad_params.get(stage, ()):
            g = local_grad(p)
            nbytes = g.numel() * g.element_size() if g is not None else 0
            self._grad_bytes += nbytes - self._grads.get(id(p), 0)
            self._grads[id(p)] = nbytes

    def live_bytes(self) -> int:
        """The bytes this rank holds now beyond its shards: the full parameters
        gathered (as :attr:`peak_gathered` counts them) and the full gradients
        noted since their REDUCE_GRAD (StageRunner.peak_live)."""
        return self._held + self._grad_bytes

    def _taken(self, params: Iterable[torch.nn.Parameter]) -> None:
        """REDUCE_GRAD took these parameters' full gradients."""
        for p in params:
            self._grad_bytes -= self._grads.pop(id(p), 0)

    @property
    def peak_gathered(self) -> int:
        """The most bytes of full parameter storages held at once in this
        executor run (begin_run resets it): last_step_stats
        ["peak_gathered_bytes"]. Gathers are counted from their unpacking
        (``_refill``) to their RESHARD (``_free``), a parameter several local
        stages read once; the collectives' own buffers, freed as ``ready``
        returns, are not."""
        return self._peak_held

    def report(self) -> dict[str, Any]:
        """The last step's collectives on this rank: all-gathers (count, bytes
        received, seconds from post to completion, seconds a compute action
        waited for them, and the share hidden behind other work),
        reduce-scatters (count, bytes sent), and the most bytes of full
        parameters the gathers held at once (their storages, NOTE [Resharding
        frees the storage]; the collectives' own buffers not counted)."""
        total = sum(done - posted for posted, done, _, _ in self._gathers)
        exposed = sum(min(waited, done - posted) for posted, done, waited, _ in self._gathers)
        return {"all_gather": {"count": len(self._gathers),
                               "bytes": sum(b for *_, b in self._gathers),
                               "seconds": total, "exposed_s": exposed,
                               "hidden_fraction": (1.0 - exposed / total) if total > 0 else 0.0},
                "reduce_scatter_bytes": self._reduced_bytes,
                "gathered_peak_bytes": self._peak_held}

    def end_step(self, wait: Callable[[Any, str], None] | None = None) -> None:
        """Wait for the step's reductions (by ``wait``, default the pipeline's)
        and add them to the shards' gradients."""
        wait = wait or self.wait
        pending, self._reductions = self._reductions, []
        for work, out, slots, replicated in pending:
            n = len(slots) + len(replicated)
            wait(work, f"the data-parallel gradient reduce-scatter ({n} tensors) over "
                      f"global ranks {self.ranks}")
            for slot in slots:
                rows = slot.shard._local_tensor.shape[slot.dim]
                g = out[slot.offset:slot.offset + rows * slot.row_numel]
                self.add_grad(slot.shard, g.view(slot.moved(rows)).movedim(0, slot.dim))
            offset = 0
            for p in replicated:
                local = self.shards.of[id(p)]._local_tensor
                self.add_grad(self.shards.of[id(p)],
                              out[offset:offset + local.numel()].view(local.shape))
                offset += local.numel()

    @staticmethod
    def add_grad(shard: torch.nn.Parameter, g: torch.Tensor) -> None:
        """Add ``g`` (this rank's part) to the shard's gradient, unless frozen."""
        if not shard.requires_grad:  # frozen (its programs may still compute it)
            return
        g = g.to(shard._local_tensor.device)  # from a host-staged reduction
        current = local_grad(shard)
        if current is None:
            set_local_grad(shard, g.clone(memory_format=torch.contiguous_format))
        else:
            current.add_(g)

    def abandon(self) -> None:
        """Forget a failed step's collectives (their works keep their buffers)."""
        self._reductions = []
        self._pending = {}
