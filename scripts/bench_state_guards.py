"""What reading Python state at every call costs (NOTE [State guards], NOTE
[Loss state]): per Hugging Face model built from a tiny config, the number of
state guards its capture keeps, one check of them, one snapshot of a loss
function's state, and one training step of the pipeline (world size 1,
interleaved_1f1b, m=2, FX programs), all measured in one run; the ratio is
what the checks add to a step.

    python scripts/bench_state_guards.py [Llama GPT2 Qwen2 ...]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import transformers as tf

import torch_mpmd as mpmd
from torch_mpmd.programs.loss_state import loss_state

torch.set_num_threads(1)


def build(name: str) -> torch.nn.Module:
    if name == "GPT2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4,
                                                use_cache=False))
    config = getattr(tf, f"{name}Config")(vocab_size=256, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, use_cache=False)
    return getattr(tf, f"{name}ForCausalLM")(config)


def per_call(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main(names: list[str]) -> None:
    weight = [1.0]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) * weight[0]

    print(f"{'model':8} {'guards':>6} {'check us':>9} {'loss state us':>13} {'step ms':>8} "
          f"{'checks/step':>11}")
    for name in names:
        torch.manual_seed(0)
        pipe = mpmd.pipeline(build(name), loss_fn=lambda out, y: loss_fn(out.logits, y),
                             schedule="interleaved_1f1b", num_microbatches=2)
        ids = torch.randint(0, 256, (4, 64))
        pipe.step(input_ids=ids, target=ids)
        state = pipe.split.captured.state
        check = per_call(state.changed, 2000)
        snap = per_call(lambda: loss_state(loss_fn), 2000)
        step = per_call(lambda: pipe.step(input_ids=ids, target=ids), 10)
        print(f"{name:8} {len(state):6d} {check * 1e6:9.0f} {snap * 1e6:13.0f} {step * 1e3:8.1f} "
              f"{(check + snap) / step:11.2%}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["Llama", "GPT2", "Qwen2", "Mistral"])
