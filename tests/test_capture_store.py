"""The capture store (NOTE [Capture store] in torch_mpmd/graph/capture_store.py):
a capture written by one process and loaded by another runs exactly as the
model does; what the graph depends on (a source file, a guarded value, the
key) differs, and the store misses instead of loading a stale graph.

Most cases run in one process with the in-process memo cleared, so the
store is what answers; one runs two real processes."""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from torch_mpmd.graph import capture_memo, capture_store
from torch_mpmd.graph.capture import capture
from torch_mpmd.graph.names import Unnamed, name_of

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    """An empty store of this test's own, and an empty memo."""
    folder = tmp_path / "captures"
    monkeypatch.setenv("MPMD_CAPTURE_CACHE", str(folder))
    capture_memo.clear()
    yield folder
    capture_memo.clear()


def _counts() -> dict[str, int]:
    return capture_store.stats()


def _delta(before: dict[str, int]) -> dict[str, int]:
    now = _counts()
    return {k: now[k] - before[k] for k in now}


MODEL_SOURCE = """
import torch
import torch.nn as nn

SCALE = {scale}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * {factor} * SCALE
"""


_writes = itertools.count()


def _import_model(path: Path, scale: float = 1.0, factor: float = 2.0, *,
                  before_start: bool = True):
    """A model module written to ``path`` and imported afresh under one name
    (an edited file read by a relaunch). ``before_start``: dated as a file
    written before this process started (the store saves no capture of a
    file changed since: see the last test), each write 10 s after the last
    (Python's bytecode cache tells versions apart by whole seconds)."""
    path.write_text(MODEL_SOURCE.format(scale=scale, factor=factor))
    if before_start:
        when = time.time() - 10_000 + 10 * next(_writes)
        os.utime(path, (when, when))
    spec = importlib.util.spec_from_file_location("mpmd_store_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mpmd_store_model"] = module
    spec.loader.exec_module(module)
    return module


def _run(captured, x: torch.Tensor) -> torch.Tensor:
    args = [x if info.kind == "input" else captured.tensors[info.name]
            for info in captured.placeholders]
    return captured.rebuild_output(list(captured.gm(*args)), {"x": x})


def _check_exact(captured, model: nn.Module, x: torch.Tensor) -> None:
    """The graph's output and every parameter's gradient equal the model's own."""
    got = _run(captured, x)
    got.sum().backward()
    graph_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = model(x)
    want.sum().backward()
    assert torch.equal(got, want)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(graph_grads[name], p.grad), name


def test_a_stored_capture_loads_in_place_of_a_trace_and_runs_exactly(tmp_path, store):
    mod = _import_model(tmp_path / "m.py")
    x = torch.randn(3, 4)
    before = _counts()
    capture(mod.Net(), (x,), {})
    assert _delta(before)["saved"] == 1
    assert len(list(store.glob("*.capture"))) == 1
    capture_memo.clear()  # as a new process: only the store knows it
    torch.manual_seed(1)
    model = mod.Net()
    before = _counts()
    loaded = capture(model, (x,), {})
    assert _delta(before)["loaded"] == 1
    assert loaded.root is model
    _check_exact(loaded, model, x)


def test_a_capture_after_a_training_step_is_stored_and_leaves_the_gradients_as_they_were(
        tmp_path, store):
    # A pipeline step leaves each parameter's gradient a view of one flat
    # buffer; the fake parameters of a capture then described them, and the
    # store could not write that description (a nested fake mode): every
    # capture made after a step (plan trials, replan, later cases) was kept
    # in the process only.
    mod = _import_model(tmp_path / "m.py")
    model = mod.Net()
    flat = torch.randn(sum(p.numel() for p in model.parameters()))
    offsets = itertools.accumulate([0] + [p.numel() for p in model.parameters()])
    for p, start in zip(model.parameters(), offsets):
        p.grad = flat[start:start + p.numel()].view_as(p)
    grads = {n: p.grad for n, p in model.named_parameters()}
    x = torch.randn(3, 4)
    before = _counts()
    capture(model, (x,), {})
    assert _delta(before)["saved"] == 1
    assert not list(store.glob("*.unsaved"))
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    capture_memo.clear()
    fresh = mod.Net()
    before = _counts()
    loaded = capture(fresh, (x,), {})
    assert _delta(before)["loaded"] == 1
    _check_exact(loaded, fresh, x)


@pytest.mark.parametrize("where", ["store", "memo"])
def test_an_edited_model_file_or_a_changed_guarded_global_is_a_miss_not_a_stale_graph(
        tmp_path, monkeypatch, where):
    """From the store, and from the memo of the same process: the edited
    file is imported as a new module object under the old name, and Dynamo's
    alias for that module (a global of the traced frame) still names the
    old one; the guard reads the module imported now."""
    if where == "memo":
        monkeypatch.setenv("MPMD_CAPTURE_CACHE", "0")
    x = torch.randn(3, 4)
    capture(_import_model(tmp_path / "m.py", factor=2.0).Net(), (x,), {})
    if where == "store":
        capture_memo.clear()
    # The same module, class and structure; the file's forward multiplies by 3.
    edited = _import_model(tmp_path / "m.py", factor=3.0)
    before = _counts()
    model = edited.Net()
    captured = capture(model, (x,), {})
    assert _delta(before)["loaded"] == 0
    if where == "store":
        assert _delta(before)["stale"] == 1
    _check_exact(captured, model, x)
    # A global the trace read (a state guard) changed: what is kept holds
    # for SCALE == 1.0 only.
    if where == "store":
        capture_memo.clear()
    edited.SCALE = 5.0
    before, memo_before = _counts(), capture_memo.stats()
    model = edited.Net()
    captured = capture(model, (x,), {})
    assert _delta(before)["loaded"] == 0
    assert capture_memo.stats()["hits"] == memo_before["hits"]
    _check_exact(captured, model, x)


def test_a_capture_of_a_file_changed_since_the_process_started_is_not_stored(tmp_path, store):
    """The code the trace ran may be the file's text from before the change;
    a later process reading the new text must not load its graph."""
    mod = _import_model(tmp_path / "m.py", before_start=False)
    before = _counts()
    capture(mod.Net(), (torch.randn(3, 4),), {})
    assert _delta(before)["saved"] == 0 and _delta(before)["not_saved"] == 1
    assert list(store.glob("*.capture")) == []


def test_a_corrupt_entry_is_a_miss_and_the_capture_traces(tmp_path, store):
    mod = _import_model(tmp_path / "m.py")
    x = torch.randn(3, 4)
    capture(mod.Net(), (x,), {})
    (entry,) = store.glob("*.capture")
    entry.write_bytes(entry.read_bytes()[:100])
    capture_memo.clear()
    model = mod.Net()
    before = _counts()
    captured = capture(model, (x,), {})
    assert _delta(before)["loaded"] == 0
    _check_exact(captured, model, x)


def test_what_has_no_name_across_processes_is_kept_in_the_process_only(store):
    class Local(nn.Module):  # a class defined in a function: another class each run
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    x = torch.randn(3, 4)
    capture(Local(), (x,), {})
    # dynamic: symbolic sizes are not stored
    capture(nn.Linear(4, 4), (x,), {}, dynamic=True)
    assert list(store.glob("*.capture")) == []
    with pytest.raises(Unnamed, match="defined inside a function"):
        name_of(Local)
    with pytest.raises(Unnamed, match="bound to a Tensor"):
        name_of(torch.zeros(1).add)


def test_functions_are_named_by_code_defaults_and_what_they_close_over():
    def make(scale):
        def f(x):
            return x * scale
        return f

    assert name_of(make(2.0)) == name_of(make(2.0))
    assert name_of(make(2.0)) != name_of(make(3.0))
    assert name_of(lambda x: x + 1) != name_of(lambda x: x + 2)
    assert name_of(torch.nn.functional.relu) == name_of(torch.nn.functional.relu)
    assert name_of((1.0, -0.0)) != name_of((1.0, 0.0))


def test_a_partial_is_named_by_its_function_and_arguments():
    """Gemma2 keeps its activation as a functools.partial: its captures were
    kept in the process only."""
    gelu = torch.nn.functional.gelu
    assert name_of(functools.partial(gelu, approximate="tanh")) == \
        name_of(functools.partial(gelu, approximate="tanh"))
    assert name_of(functools.partial(gelu, approximate="tanh")) != \
        name_of(functools.partial(gelu, approximate="none"))
    assert name_of(functools.partial(torch.add, 1)) != name_of(functools.partial(torch.add, 2))
    marked = functools.partial(gelu)
    marked.note = "its own attribute"
    with pytest.raises(Unnamed, match="partial"):
        name_of(marked)


def test_a_claim_makes_a_second_capturer_wait_until_the_first_is_done(store):
    stem = "0" * 64
    entered = threading.Event()

    def second():
        with capture_store.claim(stem):
            entered.set()

    with capture_store.claim(stem):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(0.3)  # held: the second waits
    waiter.join(10)
    assert entered.is_set()
    # A capture that was not saved does not make later claims wait.
    capture_store.mark_unsaved(stem)
    entered.clear()
    with capture_store.claim(stem):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert entered.wait(10)
    waiter.join(10)
    # A mark of an earlier launch (made before this process started, as a
    # capture of a file just edited leaves) no longer does: that launch's
    # ranks take turns again.
    long_ago = time.time() - 10_000
    os.utime(store / f"{stem}.unsaved", (long_ago, long_ago))
    entered.clear()
    with capture_store.claim(stem):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(0.3)
    waiter.join(10)
    assert entered.is_set()


def test_a_claim_just_taken_on_an_old_lock_file_is_waited_for(store):
    """A holder beats right after it takes the lock; a waiter that looks in
    between sees the time of the file's last use (an earlier launch) and
    must not take it for a stopped holder: it waits, as the ranks of a
    relaunch starting together do (both traced the model before)."""
    stem = "2" * 64
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = store / f"{stem}.lock"
    path.touch()
    long_ago = time.time() - 10_000
    os.utime(path, (long_ago, long_ago))
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # taken, not beaten yet
    entered = threading.Event()

    def second():
        with capture_store.claim(stem):
            entered.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    try:
        assert not entered.wait(0.5)
    finally:
        os.close(fd)  # released
    waiter.join(10)
    assert entered.is_set()


def test_the_least_recently_used_entries_go_when_the_store_is_full(store, monkeypatch):
    monkeypatch.setattr(capture_store, "_MAX_ENTRIES", 4)
    store.mkdir(parents=True, exist_ok=True)
    for k in range(5):
        entry = store / f"{k}-0.capture"
        entry.write_bytes(b"x")
        os.utime(entry, (1000 + k, 1000 + k))
    capture_store._prune(store)
    assert sorted(p.name for p in store.iterdir()) == ["2-0.capture", "3-0.capture",
                                                       "4-0.capture"]
    monkeypatch.setattr(capture_store, "_MAX_BYTES", 2)
    capture_store._prune(store)  # three bytes: over the size cap, down to 1
    assert [p.name for p in store.iterdir()] == ["4-0.capture"]


HOLD_AND_STOP = """
import os, signal, sys
from torch_mpmd.graph import capture_store
with capture_store.claim(sys.argv[1]):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a rank stalled while it captures
"""


def test_a_claim_held_by_a_stopped_process_does_not_hold_the_others(store, monkeypatch):
    """A holder that stops beating (SIGSTOP: alive, holding the lock) is
    passed after _HEARTBEAT_STALE seconds, not after the claim's cap."""
    monkeypatch.setattr(capture_store, "_HEARTBEAT_STALE", 1.0)
    stem = "1" * 64
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_STOP, stem],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t = time.monotonic()
        with capture_store.claim(stem):
            waited = time.monotonic() - t
        assert waited < capture_store._CLAIM_WAIT / 10, waited
    finally:
        holder.kill()
        holder.wait(30)


CROSS_PROCESS = """
import hashlib, json, sys
sys.path.insert(0, {examples!r})
import torch
from torch_mpmd.graph import capture_store
from torch_mpmd.graph.capture import capture
torch.manual_seed(0)
if {model!r} == "gpt":
    from gpt_model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16))
    kwargs = {{}}
else:  # a Hugging Face model: an output dataclass, a generation config
    import transformers
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    kwargs = {{"use_cache": False}}
x = torch.randint(0, 32, (2, 8))
captured = capture(model, (x,), kwargs)
args = [x if i.kind == "input" else captured.tensors[i.name] for i in captured.placeholders]
got = captured.rebuild_output(list(captured.gm(*args)), {{"x": x, "input_ids": x}})
logits = lambda out: out if isinstance(out, torch.Tensor) else out.logits
logits(got).float().pow(2).mean().backward()
grads = {{n: p.grad.clone() for n, p in model.named_parameters()}}
model.zero_grad()
want = logits(model(x, **kwargs))
want.float().pow(2).mean().backward()
# Against eager: the same ops, but autograd may sum a gradient in another
# order (a Hugging Face model's differ by 1e-10 at most).
close = all(p.grad is not None and torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-8)
            for n, p in model.named_parameters())
# Against the other process: the same graph, bit for bit.
digest = hashlib.sha256(b"".join(
    t.detach().numpy().tobytes() for t in (logits(got), *grads.values()))).hexdigest()
print(json.dumps({{"stats": capture_store.stats(), "close": close, "digest": digest,
                  "out": torch.equal(logits(got), want)}}))
"""


@pytest.mark.parametrize("model", ["gpt", "hf_llama"])
def test_a_second_process_loads_the_first_ones_capture_and_trains_exactly(store, model):
    script = CROSS_PROCESS.format(examples=str(ROOT / "examples"), model=model)
    results = []
    for seed in ("1", "2"):  # string hashing differs between the two processes
        env = {**os.environ, "MPMD_CAPTURE_CACHE": str(store), "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = results
    assert first["stats"]["saved"] == 1 and first["stats"]["loaded"] == 0
    assert second["stats"]["loaded"] == 1 and second["stats"]["saved"] == 0
    assert first["close"] and second["close"] and first["out"] and second["out"], results
    assert first["digest"] == second["digest"]
