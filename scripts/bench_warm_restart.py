"""One rank of a launch timed phase by phase: import, rendezvous, capture,
stage programs, and the first step as a whole (issue 33's warm restarts).

    BENCH_T0=$(date +%s.%N) torchrun --standalone --nproc-per-node 2 \\
        scripts/bench_warm_restart.py --model gpt --json /tmp/phases.json

``BENCH_T0`` is the launch's start (before torchrun); "import" is from
there to the end of this script's imports (torchrun's own start included).
"capture" and "programs" are the wall time inside torch_mpmd's capture and
stage-program builder during the first step (the memo or the capture store
answering counts as capture); "first step" is the whole first ``step()``.
Rank 0 writes the phases of every rank (each rank's own) as JSON. Run by
scripts/bench_warm_restart.sh, which launches it cold and warm.
"""

from __future__ import annotations

import os
import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_mpmd as mpmd  # noqa: E402
import torch_mpmd.graph.stage as stage_module  # noqa: E402
import torch_mpmd.runtime.program_runner as program_runner  # noqa: E402
from torch_mpmd.graph import capture_store  # noqa: E402

T_IMPORTED = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

spent = {"capture": 0.0, "programs": 0.0}


def timed(phase: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - t
    return wrapper


stage_module.capture = timed("capture", stage_module.capture)
program_runner.build_stage_programs = timed("programs", program_runner.build_stage_programs)


def build(name: str) -> tuple[torch.nn.Module, object, tuple, torch.Tensor]:
    torch.manual_seed(0)
    if name == "gpt":  # examples/train_gpt.py's defaults
        from gpt_model import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=4, n_head=4, d_model=64))
        x = torch.randint(0, 96, (16, 32))
        y = torch.randint(0, 96, (16, 32))

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        return model, loss, (x,), y
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 256, (16, 32))
    return model, None, (x,), x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--schedule", default="zbv")
    p.add_argument("--json", default="")
    args = p.parse_args()
    t0 = float(os.environ.get("BENCH_T0", T_START))
    dist.init_process_group("gloo")
    t_rendezvous = time.time()
    model, loss, inputs, target = build(args.model)
    pipe = mpmd.pipeline(model, loss_fn=loss, schedule=args.schedule, num_microbatches=4,
                         compile="inductor")
    profile = None
    if os.environ.get("BENCH_PROFILE") and dist.get_rank() == 0:
        import cProfile
        profile = cProfile.Profile()
        profile.enable()
    t = time.perf_counter()
    if loss is None:  # a Hugging Face model computes its own loss from labels
        pipe.step(inputs[0], labels=target)
    else:
        pipe.step(*inputs, target=target)
    first = time.perf_counter() - t
    if profile is not None:  # BENCH_PROFILE=PATH: rank 0's first step, for pstats
        profile.disable()
        profile.dump_stats(os.environ["BENCH_PROFILE"])
    end = time.time()
    mine = {"import": T_IMPORTED - t0, "rendezvous": t_rendezvous - T_IMPORTED,
            "capture": spent["capture"], "programs": spent["programs"], "first step": first,
            "total": end - t0, "store": capture_store.stats()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(json.dumps(everyone))
        if args.json:
            Path(args.json).write_text(json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
