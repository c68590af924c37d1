"""A capture with and without Dynamo building its guards (NOTE [Guards
never built] in torch_mpmd/graph/unguarded.py), side by side in one process.

    python scripts/bench_unguarded.py [--rounds 8]

Each model is captured again and again (no memo, no store), the two ways
in turn (A B A B ...: the machine's drift hits both alike), after one
untimed capture each. Printed per model: the median capture, and the median
time inside Dynamo's guard builder (CheckFunctionManager) per capture.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Iterator

os.environ["MPMD_CAPTURE_CACHE"] = "0"
os.environ["MPMD_CAPTURE_MEMO"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import torch  # noqa: E402


def models() -> Iterator[tuple[str, torch.nn.Module, tuple, dict]]:
    import transformers as tf
    from gpt_model import GPT, GPTConfig  # the example's model

    torch.manual_seed(0)
    yield ("example GPT (4 blocks, d=128)", GPT(GPTConfig()),
           (torch.randint(0, 96, (2, 64)),), {})
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    yield ("HF Llama (4 layers)", tf.LlamaForCausalLM(cfg), (torch.randint(0, 128, (2, 16)),),
           {"use_cache": False})
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    yield ("HF Mixtral (2 layers, 4 experts)", tf.MixtralForCausalLM(cfg),
           (torch.randint(0, 128, (2, 16)),), {"use_cache": False})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import torch._dynamo.convert_frame as convert_frame

    from torch_mpmd.graph import capture as capturing
    from torch_mpmd.graph import unguarded

    unguarded._hook()
    hooked = convert_frame.CheckFunctionManager
    spent: list[float] = []

    def timed(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return hooked(*a, **k)
        finally:
            spent.append(time.perf_counter() - start)

    convert_frame.CheckFunctionManager = timed
    ways = {"guards built": lambda code: contextlib.nullcontext(),
            "guards not built": unguarded.guards_not_built}
    print("| model | capture, guards built (s) | not built (s) | in the guard builder: built / not (s) |")
    print("|---|---|---|---|")
    for name, model, call_args, kwargs in models():
        walls: dict[str, list[float]] = {w: [] for w in ways}
        guards: dict[str, list[float]] = {w: [] for w in ways}
        for i in range(2 * (args.rounds + 1)):
            way = list(ways)[i % 2]
            capturing.guards_not_built = ways[way]
            spent.clear()
            start = time.perf_counter()
            capturing.capture(model, call_args, kwargs)
            if i >= 2:
                walls[way].append(time.perf_counter() - start)
                guards[way].append(sum(spent))
        med = {w: statistics.median(v) for w, v in walls.items()}
        g = {w: statistics.median(v) for w, v in guards.items()}
        print(f"| {name} | {med['guards built']:.3f} | {med['guards not built']:.3f} | "
              f"{g['guards built']:.3f} / {g['guards not built']:.3f} |")


if __name__ == "__main__":
    main()
