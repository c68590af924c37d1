"""The capture memo (NOTE [Capture memo] in torch_mpmd/graph/capture_memo.py):
a model captured again, or a copy of it, reuses the kept graph over its own
tensors; anything its graph depends on that differs is a new capture. In one
process: the captures are run as graphs against eager PyTorch."""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from torch_mpmd.graph import capture_memo
from torch_mpmd.graph.capture import capture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402


class Scaled(nn.Module):
    """A guarded Python value (scale), a plain tensor attribute and a
    submodule whose type decides the graph."""

    def __init__(self, scale: float = 2.0, act: nn.Module | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = act if act is not None else nn.ReLU()
        self.scale = scale
        self.offset = torch.full((4,), 0.5)
        self.options: dict[str, float] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A key the dict lacks: Dynamo guards its absence (not a value guard).
        return self.act(self.lin(x)) * self.scale * self.options.get("gain", 1.0) + self.offset


class Counting(nn.Module):
    """A forward that changes the model's Python state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x)


@pytest.fixture(autouse=True)
def fresh_memo():
    capture_memo.clear()
    yield
    capture_memo.clear()


def _run(captured, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The captured graph run on ``module``'s tensors: its output."""
    args = [x if info.kind == "input" else x.size(info.size_of[1]) if info.kind == "size"
            else captured.tensors[info.name] for info in captured.placeholders]
    with torch.no_grad():
        out = captured.gm(*args)
    return captured.rebuild_output(list(out), {"x": x})


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16))


def test_a_copy_of_a_model_reuses_the_graph_over_its_own_tensors():
    x = torch.randint(0, 32, (2, 8))
    first, second = _gpt(0), _gpt(1)
    a = capture(first, (x,), {})
    b = capture(second, (x,), {})
    assert capture_memo.stats()["hits"] == 1
    assert b.root is second and b.gm is not a.gm
    own = dict(second.named_parameters())
    assert all(b.tensors[name] is t for name, t in own.items())
    with torch.no_grad():
        want = second(x)
    assert torch.equal(_run(b, second, x), want)
    # The caller may change its graph: a later hit gets the kept one.
    for node in list(b.gm.graph.nodes):
        node.meta["changed_by_caller"] = True
    c = capture(copy.deepcopy(first), (x,), {})
    assert not any("changed_by_caller" in n.meta for n in c.gm.graph.nodes)
    assert capture_memo.stats()["hits"] == 2


@pytest.mark.parametrize("change", [
    "guarded value", "submodule type", "parameter shape", "eval mode", "hook", "patched forward",
    "input shape", "grad mode", "tied weights", "plain tensor attribute shape", "dynamic",
    "dict key"])
def test_what_the_graph_depends_on_changed_is_a_new_capture(change):
    x = torch.randn(3, 4)
    base = Scaled()
    capture(base, (x,), {})
    model, args, grad = Scaled(), (x,), True
    if change == "guarded value":
        model.scale = 3.0
    elif change == "submodule type":
        model = Scaled(act=nn.GELU())
    elif change == "parameter shape":
        model.lin = nn.Linear(4, 4, bias=False)
    elif change == "eval mode":
        model.eval()
    elif change == "hook":
        model.lin.register_forward_hook(lambda m, i, o: o * 0)
    elif change == "patched forward":
        model.forward = lambda x: Scaled.forward(model, x) + 1
    elif change == "input shape":
        args = (torch.randn(5, 4),)
    elif change == "grad mode":
        grad = False
    elif change == "tied weights":
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        capture(model, (x,), {})
        capture_memo.clear()
        capture(copy.deepcopy(model), (x,), {})
        model[1].weight = model[0].weight
    elif change == "dict key":
        model.options["gain"] = 3.0
    elif change == "plain tensor attribute shape":
        model.offset = torch.full((1,), 0.5)
    dynamic = change == "dynamic"
    with torch.set_grad_enabled(grad):
        captured = capture(model, args, {}, dynamic=dynamic)
    assert capture_memo.stats()["hits"] == 0, change
    with torch.no_grad():
        want = model(*args)
    assert torch.equal(_run(captured, model, args[0]), want), change


def test_the_same_guarded_values_hit_and_a_changed_one_is_kept_beside():
    x = torch.randn(3, 4)
    capture(Scaled(2.0), (x,), {})
    capture(Scaled(3.0), (x,), {})
    capture(Scaled(2.0), (x,), {})
    capture(Scaled(3.0), (x,), {})
    assert capture_memo.stats() == {"hits": 2, "misses": 2, "stored": 2, "not_kept": 0}


class _Layout:
    """A plain object a model holds (as a tensor parallel style does): keyed
    by its attributes' values."""

    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)


class Laid(nn.Module):
    def __init__(self, first: int, second: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layouts = [_Layout(kind="shard", dim=first), _Layout(kind="replicate", dim=second)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.layouts[1].dim


def test_objects_that_differ_only_in_a_second_attribute_key_apart():
    """Each object's attributes are keyed by value, the second as the first:
    the key once summarized the first object's attribute dict, freed, under
    the id the second's then took, so models differing only there keyed
    alike (and a key made again after a trace differed: never kept)."""
    x = torch.randn(3, 4)
    key = capture_memo.structure_key(Laid(1, 2), {"x": x}, False)
    assert key != capture_memo.structure_key(Laid(1, 3), {"x": x}, False)
    assert key == capture_memo.structure_key(Laid(1, 2), {"x": x}, False)
    capture(Laid(1, 2), (x,), {})
    other = Laid(1, 2)
    captured = capture(other, (x,), {})
    assert capture_memo.stats() == {"hits": 1, "misses": 1, "stored": 1, "not_kept": 0}
    with torch.no_grad():
        assert torch.equal(_run(captured, other, x), other(x))


def test_a_forward_that_changes_the_model_is_not_kept():
    x = torch.randn(3, 4)
    model = Counting()
    capture(model, (x,), {})
    assert model.calls == 1  # Dynamo replayed the side effect
    capture(Counting(), (x,), {})
    assert capture_memo.stats()["hits"] == 0 and capture_memo.stats()["not_kept"] == 2


@pytest.mark.parametrize("memo", ["1", "0"])
def test_a_captured_model_is_freed_with_its_last_reference(monkeypatch, memo):
    # Neither the memo nor Dynamo (which keeps every backend it is given until
    # torch._dynamo.reset()) may keep a captured model, or its tensors, alive.
    monkeypatch.setenv("MPMD_CAPTURE_MEMO", memo)
    model = Scaled()
    alive = weakref.ref(model)
    capture(model, (torch.randn(3, 4),), {})
    del model
    gc.collect()
    assert alive() is None


def test_the_memo_holds_no_object_of_the_model_and_can_be_turned_off(monkeypatch):
    x = torch.randn(3, 4)
    model = Scaled()
    capture(model, (x,), {})
    (template,) = capture_memo.kept()
    assert template.root is None and template.tensors == {}
    # Ids only (what the graph's module keys meant when traced), no modules.
    assert all(type(k) is int and type(v) is str for k, v in template.module_ids.items())
    assert template.state.scope == {"L": {}, "G": {}}
    own = {id(t) for t in [*model.parameters(), model.offset]}
    assert not any(id(v) in own for v in vars(template.gm).values())
    monkeypatch.setenv("MPMD_CAPTURE_MEMO", "0")
    capture(Scaled(), (x,), {})
    assert capture_memo.stats()["hits"] == 0 and len(capture_memo.kept()) == 1


class _Unequal:
    """A user object whose comparison raises (as numpy arrays' and some
    symbolic types' do), with no attributes to compare instead: the key holds
    it by identity."""

    __slots__ = ()

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparison")


def test_a_model_holding_an_object_that_cannot_be_compared_still_captures():
    x = torch.randn(3, 4)
    outs = []
    for _ in range(2):
        model = Scaled()
        model.tag = _Unequal()
        captured = capture(model, (x,), {})
        with torch.no_grad():
            outs.append(torch.equal(_run(captured, model, x), model(x)))
    assert outs == [True, True]
    assert capture_memo.stats()["hits"] == 0


class Stack(nn.Module):
    """Blocks of one type in a list: which block an op belongs to is known
    only from the graph's module keys (Dynamo's, made of module ids)."""

    def __init__(self, blocks: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks or [nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_a_hit_names_each_op_by_the_module_that_computes_it_whatever_ids_are_reused():
    # A hit's graph carries the traced model's module ids. The new model's ids
    # can equal some of them, for other modules: here deterministically (its
    # blocks are the first model's, swapped; as a freed model's memory would be
    # reused by chance). The ops must still belong to blocks.0 then blocks.1.
    from torch_mpmd.graph.fx_to_ir import to_ir

    x = torch.randn(3, 4)
    first = Stack()
    a = capture(first, (x,), {})
    swapped = Stack([first.blocks[1], first.blocks[0]])
    b = capture(swapped, (x,), {})
    assert capture_memo.stats()["hits"] == 1
    order = [m for m in to_ir(b.gm, b.placeholders, b.module_ids).module_fqns if m]
    assert order == [m for m in to_ir(a.gm, a.placeholders, a.module_ids).module_fqns if m]
    assert order[0].startswith("blocks.0") and order[-1].startswith("blocks.1"), order
    with torch.no_grad():
        assert torch.equal(_run(b, swapped, x), swapped(x))


def test_the_compile_door_reuses_the_capture_of_a_frame_defined_again_and_not_of_one_that_differs():
    # A training function defined again (a new closure over a copy of the
    # model) is the same frame: its FrameModule's capture is kept. A closure
    # value the loss reads (scale) is part of the graph: another one captures.
    import torch.nn.functional as F

    x = torch.randint(0, 32, (4, 8))
    y = torch.randint(0, 32, (4, 8))

    def door_step(model: nn.Module, scale: float) -> None:
        @torch.compile(backend="mpmd", options={"schedule": "gpipe", "num_microbatches": 2})
        def train_loss(x, y):
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * scale

        train_loss(x, y).backward()
        torch._dynamo.reset()

    def eager(model: nn.Module, scale: float) -> nn.Module:
        ref = copy.deepcopy(model)
        for mb in range(2):  # the pipeline's loss: the mean over its 2 microbatches
            rows = slice(2 * mb, 2 * mb + 2)
            (F.cross_entropy(ref(x[rows]).flatten(0, 1), y[rows].flatten()) * scale / 2
             ).backward()
        return ref

    for seed, scale, hits in ((0, 1.0, 0), (1, 1.0, 1), (2, 0.5, 1)):
        model = _gpt(seed)
        ref = eager(model, scale)
        door_step(model, scale)
        assert capture_memo.stats()["hits"] == hits, (seed, scale, capture_memo.stats())
        want = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name} ({seed}): {m}")


def _scaled_by(k: float):
    def act(x: torch.Tensor) -> torch.Tensor:
        return x * k
    return act


def test_a_closure_is_guarded_by_its_code_and_the_cells_it_reads():
    # As Dynamo guards a closure: the same def run again is the same state
    # (its cell, guarded on its own, holds the same value); another cell value
    # or another function's code is a change, named.
    x = torch.randn(3, 4)
    model = nn.Linear(4, 4)
    model.act = _scaled_by(2.0)
    model.forward = lambda x: model.act(nn.Linear.forward(model, x))
    captured = capture(model, (x,), {})
    model.act = _scaled_by(2.0)
    assert captured.state.changed() is None
    model.act = _scaled_by(3.0)
    assert "2.0 -> 3.0" in captured.state.changed()
    model.act = lambda x: x * 2.0
    assert captured.state.changed().endswith("(other code)"), captured.state.changed()



def _scaling_hook(scale):
    """A forward hook over a closure value, made again per model (as torch's
    parallelize_module installs a new lambda per module)."""
    return lambda module, inputs, output: output * scale


class _Gain:
    def __call__(self, module, inputs, output):
        return output * 2.0


def test_hooks_are_keyed_by_what_they_run():
    """The same hook installed again on a copy of the model (a new function
    object over equal closure values) hits; other closure values, or a
    closure holding a tensor (whose values a trace may read), do not."""
    x = torch.randn(3, 4)

    def hooked(hook) -> Scaled:
        model = Scaled()
        model.lin.register_forward_hook(hook)
        return model

    capture(hooked(_scaling_hook(2.0)), (x,), {})
    capture(hooked(_scaling_hook(2.0)), (x,), {})
    assert capture_memo.stats()["hits"] == 1
    other = hooked(_scaling_hook(3.0))
    captured = capture(other, (x,), {})
    assert capture_memo.stats()["hits"] == 1
    with torch.no_grad():
        assert torch.equal(_run(captured, other, x), other(x))
    for _ in range(2):  # a callable object: keyed as itself
        capture(hooked(_Gain()), (x,), {})
    assert capture_memo.stats()["hits"] == 1


def test_a_dynamic_capture_leaves_the_inputs_unmarked_and_is_kept():
    """pipeline(dynamic=True) and the compile door mark every input dim
    dynamic for their trace: the user's tensors come back as they were (a
    weak mark left behind made the key after the trace differ, so the
    capture was never kept), and a copy of the model hits."""
    x = torch.randn(3, 4)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    capture(Scaled(), (x,), {}, dynamic=True)
    assert x._dynamo_weak_dynamic_indices == {1}
    y = torch.randn(3, 4)
    capture(Scaled(), (y,), {}, dynamic=True)
    assert not hasattr(y, "_dynamo_weak_dynamic_indices")
    capture(Scaled(), (y,), {}, dynamic=True)
    assert capture_memo.stats()["hits"] == 1


_HOOK_SOURCE = '''
SCALE = {scale}

def hook(module, inputs, output):
    return output * SCALE
'''


def test_hooks_of_the_same_code_in_other_modules_are_other_hooks():
    """Code objects compare equal across files: a hook of the same source
    in another module (another copy of a model file) reads that module's
    globals, so it is another capture."""
    import types as pytypes

    x = torch.randn(3, 4)
    outputs = []
    for name, scale in (("mpmd_hook_a", 2.0), ("mpmd_hook_b", 3.0)):
        module = pytypes.ModuleType(name)
        exec(compile(_HOOK_SOURCE.format(scale=scale), f"/{name}.py", "exec"), module.__dict__)
        sys.modules[name] = module
        try:
            model = Scaled()
            model.lin.register_forward_hook(module.hook)
            captured = capture(model, (x,), {})
            with torch.no_grad():
                outputs.append((_run(captured, model, x), model(x)))
        finally:
            del sys.modules[name]
    assert capture_memo.stats()["hits"] == 0
    for got, want in outputs:
        assert torch.equal(got, want)


_PLACEMENT_SCRIPT = '''
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module
from torch_mpmd.graph import capture_memo
from torch_mpmd.graph.capture import capture

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
x = torch.randn(4, 6, 8)
for dim in (0, 1):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    parallelize_module(model[0], mesh, PrepareModuleOutput(
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(dim),),
        use_local_output=False))
    captured = capture(model, (x,), {})
    print(dim, capture_memo.stats()["hits"], "placements: (S(%d),)" % dim in str(captured.gm.graph))
'''


def test_hooks_that_differ_in_a_placement_are_other_captures():
    """A DTensor placement is a C++ value with an empty ``__dict__``:
    Shard(0) and Shard(1) are told apart by their own equality, so a hook
    that redistributes to another dim is another capture (a fake process
    group of 2 ranks, in a process of its own)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _PLACEMENT_SCRIPT], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["0 0 True", "1 0 True"], out.stdout + out.stderr[-2000:]
