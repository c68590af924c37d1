"""The default process group of a job that torchrun may restart.

NOTE [Keys of an earlier launch]: torchrun's agent hosts the job's store and
keeps it across the restarts of ``--max-restarts``. ``init_process_group``
over it writes and reads the same keys in every launch (each rank's gloo
address; torch_mpmd's records of ranks that left), so a restarted rank can
read the dead launch's values: gloo then dials a closed port ("Gloo
connectFullMesh failed", in most restarts on this 2-core machine), or a rank
is taken for one that left. :func:`init_process_group` gives each launch its
own key space: the agent's store under a prefix naming the restart count.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_process_group(backend: str | None = None,
                       timeout: datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` for a job that torchrun may
    restart (NOTE [Keys of an earlier launch]); outside torchrun, or without
    its agent's store, the plain ``env://`` initialisation. ``backend``:
    default gloo on CPU, nccl where CUDA is available. A no-op when the
    default group exists."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kw = {} if timeout is None else {"timeout": timeout}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **kw)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, **kw)
    launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"mpmd/launch{launch}/", store),
                            rank=rank, world_size=world, **kw)
