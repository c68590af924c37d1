"""One launch of tests/test_warm_restart.py: a 2-rank pipeline of the model in
``warm_model`` (a file the test writes, on ``PYTHONPATH``) with Inductor
programs takes one step; each rank writes ``$WARM_OUT/rank{R}.pt``: the
loss, its held parameters' gradients, one process's loss and gradients of
the same batch (the reference), the capture store's counts and Inductor's
cache counters of this process."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import torch_mpmd as mpmd
import warm_model
from torch_mpmd.graph import capture_store


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def main() -> None:
    mpmd.init_process_group("gloo")
    torch.manual_seed(0)
    model = warm_model.Net()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    pipe = mpmd.pipeline(model, loss_fn=mse, schedule="1f1b", num_microbatches=2,
                         split_points=["layers.2"], compile="inductor", timeout=120)
    loss = pipe.step(x, target=y)
    want = mse(reference(x), y)  # equal microbatches: the mean of their means
    want.backward()
    ref = dict(reference.named_parameters())
    held = dict(pipe.named_parameters())
    torch.save(dict(loss=loss.item(), grads={n: p.grad for n, p in held.items()},
                    want_loss=want.item(), want={n: ref[n].grad for n in held},
                    store=capture_store.stats(), inductor=dict(counters["inductor"])),
               os.path.join(os.environ["WARM_OUT"], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
