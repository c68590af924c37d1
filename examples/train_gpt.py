"""Train a small character-level GPT with torch_mpmd pipeline parallelism.

Run it (from the repository root, on a fresh machine; sets up, then trains on 2 ranks):

    bash scripts/run_example.sh

or, once set up:

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --schedule zbv
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --dp 2 --tp 2 --shard
    python examples/train_gpt.py                      # one process: every stage local

Options: --schedule {gpipe,1f1b,interleaved_1f1b,looped_bfs,zero_bubble,zbv,dualpipev}
(default 1f1b), --microbatches 8, --steps 60, --lr, --batch-size, --seed, --layers,
--stages-per-rank (default 2 for interleaved_1f1b, looped_bfs, zbv and dualpipev, else 1),
--device cpu, --out-dir out (the last step's Chrome trace and measured timeline PNG),
--dp 2 (pipeline replicas: torchrun 4 processes = dp 2 x pp 2), --checkpoint-dir ckpt
(save at the end, with the step and the LR scheduler), --resume (start from its latest
checkpoint; any pipeline size), --clip 1.0 (global gradient-norm clipping over all stages;
0: none), --eval-every 20 (the loss on a held-out batch, forward only; 0: never),
--tp 2 (tensor parallel inside every stage: each block's attention and MLP
split over 2 ranks with DTensor; world size = dp x pp x tp),
--shard (with --dp: sharded data parallel, ZeRO-3: parameters, gradients and
optimizer state split over the replicas, gathered per stage by the schedule's
UNSHARD actions; with --tp too: 2-D shards), --compile (stage programs compiled by Inductor), --door (train through
torch.compile(train_loss, backend="mpmd") and loss.backward() instead of pipe.step),
--packed (the corpus's sentences as documents, packed into rows with mpmd.pack,
attention kept within each document, a token-weighted loss).

The model is examples/gpt_model.py's GPT (token embedding tied to the
unembedding, so the first and last stage share one weight); the corpus is a
few KB of English embedded in examples/corpus.py (its last tenth held out for
evaluation). Every rank builds the same model from the same seed and reads the
same batches; the pipeline splits the model at split_points=["blocks.K", ...],
each rank runs only its own stages, and `pipe.step` returns the same mean loss
on every rank. A step is the usual loop: `pipe.step`, `pipe.clip_grad_norm_`
(the norm over every stage, the tied weight counted once), the optimizer and
the LR scheduler; every --eval-every steps `pipe.eval_step` gives the
held-out loss. Rank 0 prints a progress line, the first and last loss, and a
short sample; the run exits non-zero if the loss did not fall.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # gpt_model, corpus
sys.path.append(os.path.dirname(_HERE))  # the checkout's torch_mpmd, if it is not installed

import torch_mpmd as mpmd  # noqa: E402
from corpus import TEXT  # noqa: E402
from gpt_model import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402

SCHEDULES = tuple(mpmd.schedules.schedule_names())
# Stages per rank each schedule runs with unless told: the fewest that show
# what it is for (the schedule table's; V schedules need exactly 2).
MULTI_STAGE = {name: mpmd.schedules.facts(name).typical_stages_per_rank for name in SCHEDULES
               if mpmd.schedules.facts(name).typical_stages_per_rank > 1}
MIN_LOSS_DROP = 0.05  # nats; the check at the end that the run trained


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default=mpmd.schedules.DEFAULT.schedule, choices=SCHEDULES)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out-dir", default="out",
                   help="where the last step's Chrome trace and timeline PNG go (default: out/)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, split into microbatches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32, help="context length in characters")
    p.add_argument("--stages-per-rank", type=int, default=None,
                   help=f"default: 2 for {', '.join(MULTI_STAGE)}; else 1")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of the pipeline (world size = dp x pp x tp)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per stage (world size = dp x pp x tp): each "
                        "block's attention and MLP split over them with DTensor")
    p.add_argument("--shard", action="store_true",
                   help="with --dp: shard parameters, gradients and optimizer state over the "
                        "replicas (pipeline(data_parallel='shard'))")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save model and optimizer here at the end (torch.distributed.checkpoint)")
    p.add_argument("--resume", action="store_true",
                   help="start from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--eval-every", type=int, default=20,
                   help="held-out loss every N steps and at the last (0: never)")
    p.add_argument("--compile", action="store_true",
                   help="compile each stage's programs (F, B or I/W) with Inductor")
    p.add_argument("--door", action="store_true",
                   help="train through torch.compile(train_loss, backend='mpmd'): the loss "
                        "inside the compiled function, loss.backward() (no --resume)")
    p.add_argument("--packed", action="store_true",
                   help="train on the corpus's sentences packed into rows (mpmd.pack), "
                        "attention within each, a token-weighted loss")
    p.add_argument("--sample-chars", type=int, default=100, help="characters to sample at the end (0: none)")
    args = p.parse_args()
    if args.stages_per_rank is None:
        args.stages_per_rank = MULTI_STAGE.get(args.schedule, 1)
    if args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}")
    return args


# ---------------------------------------------------------------- data

class CharData:
    """The embedded corpus as character ids, and a deterministic batch sampler.

    Every rank seeds the sampler identically, so all ranks read the same
    batches without communicating. ``part``: "train" samples the first
    ``1 - HELD_OUT`` of the text, "held_out" the rest (one vocabulary for both).
    """

    HELD_OUT = 0.1

    def __init__(self, text: str, block_size: int, seed: int, part: str = "train") -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * (1 - self.HELD_OUT))
        self.ids = ids[:cut] if part == "train" else ids[cut:]
        self.block_size = block_size
        self.gen = torch.Generator().manual_seed(seed)
        if len(self.ids) <= block_size + 1:
            raise ValueError(f"corpus of {len(self.ids)} chars is too short for block size {block_size}")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, block_size); targets are inputs shifted by one."""
        offsets = torch.randint(0, len(self.ids) - self.block_size - 1, (batch_size,), generator=self.gen)
        x = torch.stack([self.ids[o:o + self.block_size] for o in offsets.tolist()])
        y = torch.stack([self.ids[o + 1:o + 1 + self.block_size] for o in offsets.tolist()])
        return x, y

    def packed_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        """``batch_size`` rows of ``block_size`` characters packed from whole
        sentences (random ones, each cut to ``block_size``), as mpmd.pack
        gives them: input_ids, labels, position_ids, document_ids."""
        if not hasattr(self, "_sentences"):
            text = self.ids.tolist()
            period = self.stoi.get(".")
            self._sentences, start = [], 0
            for i, c in enumerate(text):
                if c == period or i == len(text) - 1:
                    if i + 1 - start >= 2:
                        self._sentences.append(torch.tensor(text[start:i + 1]))
                    start = i + 1
        docs, tokens = [], 0
        while tokens < batch_size * self.block_size:
            k = int(torch.randint(len(self._sentences), (1,), generator=self.gen))
            docs.append(self._sentences[k][:self.block_size])
            tokens += len(docs[-1])
        rows = mpmd.pack(docs, tokens_per_microbatch=self.block_size).batch(self.block_size)
        return {name: t[:batch_size] for name, t in rows.items()}

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------- model

def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The same GPT on every rank (same seed), with a GPT-2 style small init.

    nn.Embedding's default N(0, 1) init, tied to the unembedding, would make
    the first logits huge (initial loss ~40); std 0.02 starts near ln(vocab).
    """
    torch.manual_seed(seed)
    model = GPT(cfg)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def split_points(n_layer: int, num_stages: int) -> list[str] | None:
    """Module FQNs where stages 1..num_stages-1 begin: blocks spread evenly over the stages.

    Stage 0 also holds the embeddings, the last stage ln_f and the (tied) head.
    """
    if num_stages > n_layer:
        raise SystemExit(f"--layers {n_layer} is too few for {num_stages} stages "
                         f"(pipeline size x stages per rank); use --layers {num_stages} or more")
    points = [f"blocks.{(i * n_layer) // num_stages}" for i in range(1, num_stages)]
    return points or None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross entropy; logits (b, t, vocab), targets (b, t)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token-weighted loss for packed rows: (sum of the cross entropies of the
    labelled positions, their count); the step divides the batch's sum by its
    count (labels -100 at document ends and padding count nothing)."""
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    return total, (labels != -100).sum()


# ---------------------------------------------------------------- output

class Progress:
    """A hand-written progress line on rank 0: `\\r` updates, a newline every `every` steps."""

    def __init__(self, total: int, label: str, every: int = 10, width: int = 24) -> None:
        self.total, self.label, self.every, self.width = total, label, every, width

    def update(self, step: int, loss: float, tokens_per_s: float,
               held_out: float | None = None) -> None:
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        val = f"held-out {held_out:6.3f}  " if held_out is not None else ""
        line = (f"\r[{bar}] step {step:>{len(str(self.total))}}/{self.total}  loss {loss:6.3f}  "
                f"{val}{tokens_per_s:8.0f} tok/s  {self.label}")
        end = "\n" if step % self.every == 0 or step == self.total else ""
        print(line, end=end, flush=True)


@torch.no_grad()
def sample(pipe, data: CharData, batch_size: int, n_chars: int, seed: int,
           device: torch.device) -> tuple[str, str]:
    """(prompt, n_chars generated after it), with forward-only `pipe(x)`.

    Every rank must make the same calls with the same inputs, so the prompt
    and the sampling generator are the same everywhere (and the logits come
    back on every rank). The window stays at block_size and the batch at
    batch_size, the shapes the pipeline was captured with; row 0 is used.
    """
    gen = torch.Generator().manual_seed(seed)
    context = data.ids[: data.block_size].tolist()
    out = []
    for _ in range(n_chars):
        x = torch.tensor(context[-data.block_size:], dtype=torch.long, device=device)
        logits = pipe(x.expand(batch_size, -1).contiguous())
        probs = torch.softmax(logits[0, -1].float().cpu() / 0.8, dim=-1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        context.append(nxt)
        out.append(nxt)
    return data.decode(context[: data.block_size]), data.decode(out)


def held_out_loss(pipe, batch: tuple[torch.Tensor, torch.Tensor], door: bool = False) -> float:
    """The mean loss on a held-out batch: forward and loss only, in eval mode
    (the pipeline keeps one capture per mode, so switching back is free).
    The compile door's pipeline computes the loss itself from (x, y)."""
    pipe.eval()
    loss = (pipe.eval_step(batch[0], batch[1]) if door else
            pipe.eval_step(batch[0], target=batch[1]))
    pipe.train()
    return float(loss)


def linear_decay(total_steps: int):
    """LR factor: from 1 down to 0.1 over ``total_steps``, then 0.1."""
    return lambda step: max(0.1, 1.0 - 0.9 * step / max(1, total_steps))


# ---------------------------------------------------------------- main

def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # ranks share the CPU cores

    device = torch.device(args.device)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if world % (args.dp * args.tp):
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} does not divide the world size {world}")
    pp = world // (args.dp * args.tp)
    mesh = None
    if args.dp > 1 or args.tp > 1:  # replicas of the pipeline, tensor parallel inside stages
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, pp, args.tp),
                                mesh_dim_names=("dp", "pp", "tp"))
    dp_rank = mesh.get_local_rank("dp") if mesh is not None else 0
    is_main = rank == 0

    data = CharData(TEXT, args.block_size, args.seed + 1000 * dp_rank)
    held_out = CharData(TEXT, args.block_size, args.seed + 1, part="held_out")
    eval_batch = tuple(t.to(device) for t in held_out.batch(args.batch_size))
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size, n_layer=args.layers,
                    n_head=4, d_model=args.d_model)
    model = build_model(cfg, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.tp > 1:  # before pipeline(), torchtitan's way: the stages keep the DTensors
        from torch.distributed.tensor.parallel import parallelize_module

        for block in model.blocks:
            parallelize_module(block, mesh["tp"], tensor_parallel_plan())
    num_stages = pp * args.stages_per_rank
    points = split_points(args.layers, num_stages)

    settings = dict(schedule=args.schedule, num_microbatches=args.microbatches,
                    stages_per_rank=args.stages_per_rank, split_points=points, device=device,
                    seed=args.seed, mesh=mesh, compile="inductor" if args.compile else False)
    if args.packed and args.door:
        raise SystemExit("--packed trains through pipe.step (not --door)")
    if args.shard:
        if mesh is None or args.door:
            raise SystemExit("--shard needs --dp 2 or more (and not --door)")
        settings["data_parallel"] = "shard"
    if args.door:  # the compile door: the same pipeline, built on the first call
        if args.resume:
            raise SystemExit("--door does not take --resume (its pipeline exists after the "
                             "first call; resume with the pipeline() loop)")

        @torch.compile(backend="mpmd", options=settings)
        def train_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(model(x), y)

        pipe = None
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        pipe = mpmd.pipeline(model, loss_fn=token_loss if args.packed else lm_loss,
                             **settings)
        # Before the first step (capture) this is the whole model's parameters;
        # those that end up on other ranks' stages never get a .grad here, and
        # AdamW skips parameters without one.
        opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(args.steps))
    start = 0  # steps taken before this run (a resumed run continues the count)
    if args.resume:
        if not args.checkpoint_dir:
            raise SystemExit("--resume needs --checkpoint-dir")
        got = mpmd.checkpoint.load(pipe, opt, args.checkpoint_dir,
                                   extra={"lr_scheduler": sched})
        start = int(got["extra"].get("step", 0))
        if is_main:
            print(f"resumed from {got['directory']} at step {start} "
                  f"(lr {sched.get_last_lr()[0]:.2e})")

    if is_main:
        print(f"GPT: {args.layers} layers, d_model {args.d_model}, vocab {data.vocab_size}, "
              f"{n_params / 1e3:.1f}K params; corpus {len(data.ids)} chars")
        print(f"pipeline: {args.schedule}, pp={pp}, dp={args.dp}, tp={args.tp}, {num_stages} stages "
              f"({args.stages_per_rank} per rank), split_points={points}, "
              f"data parallel {'sharded' if args.shard else 'replicated'}, "
              f"{args.microbatches} microbatches of {args.batch_size // args.microbatches}, "
              f"device {device}")

    label = (f"{args.schedule} pp={pp}" + (" compiled" if args.compile else "")
             + (" (compile door)" if args.door else ""))
    progress = Progress(args.steps, label)
    tokens_per_step = args.batch_size * args.block_size
    losses: list[float] = []
    held_out_losses: list[float] = []
    timed_tokens, timed_seconds = 0, 0.0
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if args.packed:
            rows = {k: v.to(device) for k, v in data.packed_batch(args.batch_size).items()}
            x, y = rows["input_ids"], rows["labels"]
        else:
            x, y = data.batch(args.batch_size)
        t0 = time.perf_counter()
        if args.packed:
            loss = pipe.step(x, position_ids=rows["position_ids"],
                             document_ids=rows["document_ids"], target=y)
        elif args.door:
            loss = train_loss(x.to(device), y.to(device))  # the whole schedule
            loss.backward()  # hands the local parameters their gradients
            pipe = mpmd.pipeline_of(train_loss)  # for clipping, evaluation and traces
        else:
            loss = pipe.step(x.to(device), target=y.to(device))
        if args.clip > 0:  # the norm over every stage: the same scaling on every rank
            pipe.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step > 1:  # the first step includes capture and partitioning
            timed_tokens += tokens_per_step
            timed_seconds += dt
        if args.eval_every > 0 and step % args.eval_every == 0 and step < args.steps:
            held_out_losses.append(held_out_loss(pipe, eval_batch, args.door))
        if is_main:
            tps = timed_tokens / timed_seconds if timed_seconds else tokens_per_step / dt
            progress.update(step, losses[-1], tps,
                            held_out_losses[-1] if held_out_losses else None)
            if step == 1:  # captured now: the stages are known
                print(f"\nrank 0 runs stages {pipe.local_stages} of {pipe.num_stages}"
                      f" (capture + first step {dt:.1f}s)")
    wall = time.perf_counter() - t_start

    # What the last step did: every rank's measured bubble and activation
    # memory, a Chrome trace and the measured timeline next to the simulated
    # one (collectives: every rank calls them; rank 0 writes the files).
    bubbles = mpmd.trace.bubble_fractions(pipe.timelines())  # idle share of the whole step
    stats = pipe.last_step_stats
    mine = torch.tensor([sum(stats["peak_activation_bytes"].values())], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    if distributed:
        dist.all_gather(everyone, mine)
    else:
        everyone = [mine]
    os.makedirs(args.out_dir, exist_ok=True)
    trace_path = os.path.join(args.out_dir, "train_gpt_trace.json")
    png_path = os.path.join(args.out_dir, "train_gpt_timeline.png")
    pipe.save_trace(trace_path)
    pipe.save_timeline(png_path)
    if is_main:
        print("last step, per rank: bubble " + ", ".join(f"{b:.0%}" for b in bubbles) +
              "; peak activations " + ", ".join(f"{float(t[0]) / 2**20:.1f} MiB" for t in everyone))
        print(f"trace: {trace_path} (chrome://tracing, ui.perfetto.dev); timeline: {png_path}")
        gathers = stats.get("collectives", {}).get("all_gather")
        if gathers:  # sharded data parallel: how much of the parameter gathers compute hid
            print(f"rank 0 parameter all-gathers: {gathers['count']} of "
                  f"{gathers['bytes'] / gathers['count'] / 2**10:.0f} KiB, "
                  f"{gathers['hidden_fraction']:.0%} hidden behind other work")

    # The held-out loss after the last step: evaluated after the trace was
    # written, which shows the last run of the pipeline (a training step).
    if args.eval_every > 0:
        held_out_losses.append(held_out_loss(pipe, eval_batch, args.door))

    # Smoke check that the run trained: the mean of the last (up to 5) losses,
    # step 1 excluded, must be MIN_LOSS_DROP below the first (batch-to-batch
    # noise at a fixed model is ~0.01).
    first, last = losses[0], losses[-1]
    tail = losses[max(1, len(losses) - 5):] or losses
    last_mean = sum(tail) / len(tail)
    # A resumed run starts from a trained model, where 10 steps need not gain
    # MIN_LOSS_DROP: it only has to stay finite and not get worse.
    fell = math.isfinite(last_mean) and (
        last_mean < first - MIN_LOSS_DROP if not args.resume else last_mean < first + MIN_LOSS_DROP)
    if is_main:
        tps = timed_tokens / timed_seconds if timed_seconds else float("nan")
        print(f"done: {args.steps} steps in {wall:.1f}s, {tps:.0f} tok/s after the first step "
              f"({args.schedule}, pp={pp})")
        print(f"loss: first {first:.3f}, last {last:.3f} (mean of last {len(tail)}: {last_mean:.3f})")
        if len(held_out_losses) > 1:
            print(f"held-out loss: first {held_out_losses[0]:.3f}, last {held_out_losses[-1]:.3f}"
                  f" ({len(held_out_losses)} evaluations)")
        elif held_out_losses:
            print(f"held-out loss: {held_out_losses[0]:.3f}")

    if args.checkpoint_dir:  # with the loop's own state: the step count and the LR schedule
        where = mpmd.checkpoint.save(pipe, opt, args.checkpoint_dir,
                                     extra={"step": start + args.steps, "lr_scheduler": sched})
        if is_main:
            print(f"checkpoint: {where}")

    if args.sample_chars > 0 and fell and not args.door:  # the door's pipeline takes (x, y)
        t0 = time.perf_counter()
        prompt, generated = sample(pipe, data, args.batch_size, args.sample_chars, args.seed, device)
        if is_main:
            print(f"sample ({len(generated)} chars after the prompt {prompt!r}, forward-only, "
                  f"{time.perf_counter() - t0:.1f}s):\n{prompt}{generated}")

    # Shut down in order: every rank done, then the pipeline (whose transport
    # holds the process group) released, then the group destroyed.
    if distributed:
        dist.barrier()
    del pipe, opt
    gc.collect()
    if distributed:
        dist.destroy_process_group()
    if not fell:
        if is_main:
            print(f"FAILED: the loss did not fall by {MIN_LOSS_DROP} (first {first:.3f}, mean of the "
                  f"last {len(tail)} {last_mean:.3f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
