"""Checkpoints through torch.distributed.checkpoint, under the original FQNs.

    mpmd.checkpoint.save(pipe, opt, "ckpt",                      # collective
                         extra={"step": i, "lr_scheduler": sched, "data": loader_state},
                         extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    got = mpmd.checkpoint.load(pipe, opt, "ckpt",                # collective
                               extra={"lr_scheduler": sched},
                               extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    got["extra"]["step"], got["extra"]["data"], got["step"], got["directory"]

Each rank writes its stages' parameters, buffers and optimizer state under the
module's own FQNs (DCP stores a tensor held by several ranks once), so a
checkpoint saved with one pipeline size loads into another, or into the
unsplit module in one process.

User state (``extra``): a value with ``state_dict()``/``load_state_dict()``
(DCP's Stateful: an LR scheduler, a stateful data loader, :class:`RNGState`)
is saved through its ``state_dict()`` and restored in place by ``load`` when
passed there under the same name; any other value (ints, floats, strings,
lists, tuples, dicts, tensors) is saved and comes back in ``load``'s result.
``extra`` is saved once, from rank 0; ``extra_per_rank`` once per rank (the
RNG) and restored on the rank of the same number. Non-tensor values are stored
as JSON (tagged for tuples, bytes and non-string dict keys), tensors through
DCP: nothing of ours is pickled.

Loading runs no code from the checkpoint. Besides ``extra`` (above), a
checkpoint carries tensors and plain values only: None, bool, int, float,
complex, str, bytes, and tuples, lists, sets and dicts of them (the
optimizer's param-group options, what a module's state dict holds besides
tensors); ``save`` refuses anything else in the module's or optimizer's state,
naming the key. DCP pickles its
``.metadata`` and every non-tensor item; ``load`` reads them with unpicklers
that resolve only the names those hold (DCP's metadata dataclasses, torch.Size,
dtypes and layouts; the builtins of plain values) and refuses any other name
before calling anything, naming the file (and key). Tensor data are read with
``torch.load(weights_only=True)``.

NOTE [Checkpoint layout]:
------------------------

    path/latest                   "step_7.1\\n": the current checkpoint (atomic rename)
    path/step_7/                  an older save of step 7, untouched by later ones
    path/step_7.1/.metadata       DCP's index (rank 0)
    path/step_7.1/__<r>_0.distcp  DCP's data written by rank r
    path/step_7.1/rank_<r>.json   rank r's manifest: a CRC32 of every item it
                                  wrote (key, file, byte range), its
                                  extra_per_rank state, and on rank 0 ``extra``;
                                  a sha256 of each extra entry and, on rank 0,
                                  of .metadata

Every save goes to a directory that did not exist: ``step_<k>``, or
``step_<k>.<n>`` (n one past the highest) when a save of step k exists, so a
save never writes into what ``latest`` names. Only when every rank has written
its data and manifest does rank 0 replace ``latest`` (write, fsync, rename), so
a save that dies part-way, on any rank, leaves the previous checkpoint current
and whole. Each save first removes the directories of saves that died
part-way (a step directory without every rank's manifest, never the one
``latest`` names), and a rank whose save fails because another died raises a
CheckpointError saying so. ``keep_last=n`` then removes all but the current
and the n-1 most recently completed checkpoints.

``load`` checks before it reads anything (and every rank raises the same
error, whose first line names the problem): with ``strict`` (the default) the
checkpoint's model and optimizer keys must be exactly those of the module and
optimizer over all ranks, with the same shapes; every file it reads must be
there; every item it reads must match the CRC32 recorded at save, else the
error names the key and the file; ``.metadata`` must match its sha256 (checked
before it is read) and every ``extra`` / ``extra_per_rank`` entry its own, else
the error names the file and the entry. A load is all or nothing: one that
fails anywhere (also inside DCP's read, or in a Stateful's load_state_dict)
leaves the module, the optimizer, the step counter and the Stateful objects
exactly as they were (state.Undo). Neither save nor load ever calls the
optimizer's step() (state.no_optimizer_step). Every wait for the other ranks
is bounded by ``timeout=`` (NOTE [Checkpoint waits] in checkpoint/sync.py).
The optimizer's param-group options (lr,
initial_lr, ...) are stored per parameter and not compared: those both have
load. The CRC32 covers each item's bytes as written (read back after the save), and
load reads the bytes of the items it needs once more to verify them before DCP
does; tensors of the user's state come back on the CPU.

``save`` never changes the optimizer. An optimizer built before the first
step (the whole module's parameters) is saved with this rank's parameters
only, and trimmed to them by ``load`` after capture.

The package, by job:

    saving.py    save: check, write through DCP, checksums, point ``latest``
    loading.py   load: check everything first, then read; all or nothing
    state.py     the module's and optimizer's state as DCP's state dict
    extra.py     the user's state (extra, extra_per_rank) as JSON; RNGState
    plain.py     reading pickles without running code (restricted unpicklers)
    manifest.py  the per-rank manifests: CRC32 of every item, sha256 of the rest
    layout.py    step directories, ``latest``, removing unfinished and old saves
    sync.py      the save's and load's collectives, bounded; CheckpointError
"""

from __future__ import annotations

from torch_mpmd.checkpoint.extra import RNGState
from torch_mpmd.checkpoint.layout import latest
from torch_mpmd.checkpoint.loading import load
from torch_mpmd.checkpoint.saving import save
from torch_mpmd.checkpoint.sync import CheckpointError

__all__ = ["save", "load", "latest", "RNGState", "CheckpointError"]
