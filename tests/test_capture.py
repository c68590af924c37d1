"""Capture (torch_mpmd.graph.capture) and FX -> IR (torch_mpmd.graph.fx_to_ir), single process."""

import inspect
import pathlib

import pytest
import torch
import torch.nn as nn

import models
import torch_mpmd as mpmd
from torch_mpmd import _C
from torch_mpmd.graph.capture import CaptureError, capture
from torch_mpmd.graph.fx_to_ir import module_path_to_fqn, order_mutations, resolve_split_points, to_ir
from torch_mpmd.graph.markers import STAGE_BOUNDARY_OP

K = _C.NodeKind


def captured_ir(model, *args, **kwargs):
    cap = capture(model, args, kwargs)
    order_mutations(cap.gm.graph)
    return cap, to_ir(cap.gm, cap.placeholders, cap.module_ids)


def test_stage_boundary_is_a_noop_when_the_model_runs_eagerly():
    torch.manual_seed(0)
    with_markers, without = models.MLP(markers=True), models.MLP(markers=False)
    without.load_state_dict(with_markers.state_dict())
    x = torch.randn(3, 16)
    assert mpmd.stage_boundary() is None
    torch.testing.assert_close(with_markers(x), without(x), rtol=0, atol=0)


def test_marker_survives_fullgraph_capture_and_dead_code_elimination():
    cap = capture(models.MLP(depth=4), (torch.randn(2, 16),), {})
    graph = cap.gm.graph
    graph.eliminate_dead_code()
    markers = [n for n in graph.nodes if n.target is STAGE_BOUNDARY_OP]
    assert len(markers) == 3


def test_parameters_and_buffers_map_back_to_their_fqns_and_tensors():
    model = models.ResCNN()
    cap = capture(model, (torch.randn(2, 3, 8, 8),), {})
    names = {p.name: p.kind for p in cap.placeholders}
    assert {n for n, k in names.items() if k == "parameter"} == {
        n for n, _ in model.named_parameters()}
    assert {n for n, k in names.items() if k == "buffer"} == {n for n, _ in model.named_buffers()}
    assert names["x"] == "input"
    params = dict(model.named_parameters())
    for fqn, t in cap.tensors.items():
        assert t is params.get(fqn, dict(model.named_buffers()).get(fqn))


def test_tied_weights_are_one_placeholder_under_the_first_fqn_with_the_alias_kept():
    cap = capture(models.CharGPT(n_layer=1), (torch.randint(0, 32, (2, 8)),), {})
    tied = [p for p in cap.placeholders if p.name == "wte.weight"]
    assert len(tied) == 1 and tied[0].aliases == ("lm_head.weight",)
    assert not any(p.name == "lm_head.weight" for p in cap.placeholders)


def test_user_inputs_are_named_by_forward_signature_and_non_tensors_recorded():
    model = models.MultiInputAttention()
    tokens, feats = torch.randint(0, 20, (2, 5)), torch.randn(2, 5, 6)
    mask = torch.ones(2, 5, dtype=torch.long)
    cap = capture(model, (tokens, feats), {"attention_mask": mask, "scale": 0.5})
    inputs = {p.name for p in cap.placeholders if p.kind == "input"}
    assert inputs == {"tokens", "features", "attention_mask"}
    assert cap.input_constants == {"scale": 0.5}
    assert cap.input_names == ["tokens", "features", "attention_mask"]


def test_nested_inputs_are_named_by_their_pytree_path():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, batch, *extra):
            return self.lin(batch["x"]) + extra[0]

    cap = capture(Nested(), ({"x": torch.randn(2, 4)}, torch.randn(2, 4)), {})
    assert {p.name for p in cap.placeholders if p.kind == "input"} == {"batch['x']",
                                                                        "extra[0]"}


def test_graph_break_is_a_capture_error_naming_reason_and_source_line():
    source = pathlib.Path(models.__file__)
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1)
                if "BRANCH-LINE" in text)
    with pytest.raises(CaptureError) as info:
        capture(models.DataDependentBranch(), (torch.randn(2, 8),), {})
    message = str(info.value)
    assert f"{source}:{line}" in message
    assert "Data-dependent branching" in message
    assert "torch.cond" in message  # a way out
    assert isinstance(info.value, ValueError)


def test_repeated_captures_leave_no_compiled_code_and_hit_no_recompile_limit():
    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        cap = capture(models.MLP(depth=2), (torch.randn(2, 16),), {})
        assert len([n for n in cap.gm.graph.nodes if n.target is STAGE_BOUNDARY_OP]) == 1
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    assert _debug_get_cache_entry_list(models.MLP.forward.__code__) == []


def test_capture_leaves_parameters_buffers_and_rng_untouched():
    model = models.ResCNN()
    x = torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    capture(model, (x,), {})
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class _BranchOnGrad(nn.Module):
    """A forward that reads whether a gradient exists."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if self.lin.weight.grad is None:
            x = x * 2
        return self.lin(x)


def test_a_forward_that_reads_a_gradient_is_traced_with_the_gradients_as_they_are():
    # The capture hides the parameters' gradients from Dynamo (faking a view
    # gradient is slow); a forward that reads one is traced again with them.
    model = _BranchOnGrad()
    model.lin.weight.grad = grad = torch.ones(4, 4)
    x = torch.randn(2, 4)
    cap = capture(model, (x,), {})
    args = [x if info.kind == "input" else cap.tensors[info.name] for info in cap.placeholders]
    assert torch.equal(cap.gm(*args)[0], model(x))
    assert model.lin.weight.grad is grad


def test_ir_has_every_node_kind_with_fqns_sizes_and_module_paths():
    model = models.CharGPT(n_layer=2)
    cap, ir = captured_ir(model, torch.randint(0, 32, (2, 8)))
    nodes = ir.graph.nodes
    kinds = {n.kind for n in nodes}
    assert {K.INPUT, K.PARAMETER, K.CONSTANT, K.COMPUTE, K.OUTPUT} <= kinds
    assert nodes[-1].kind == K.OUTPUT and ir.num_markers == 0
    _C.check_graph(ir.graph)
    # The positional arange and the causal mask depend on no input: Constants.
    consts = [n for n in nodes if n.kind == K.CONSTANT]
    assert any("arange" in n.target for n in consts) and any("ones" in n.target for n in consts)
    params = {n.fqn: n for n in nodes if n.kind == K.PARAMETER}
    assert params["wte.weight"].output_bytes == 32 * 32 * 4
    qkv = next(n for n in nodes if n.module_fqn == "blocks.1.attn.qkv")
    assert "linear" in qkv.target
    # FLOPs of a linear: 2 * (2*8 tokens) * 32 in * 96 out; output is 2*8*96 fp32.
    assert qkv.cost == 2 * 16 * 32 * 96 and qkv.output_bytes == 16 * 96 * 4
    assert "blocks.0.attn" in ir.module_fqns and "blocks.1.mlp.0" in ir.module_fqns


def test_markers_are_kept_as_positions_and_restored_in_the_marker_graph():
    cap, ir = captured_ir(models.MLP(depth=3), torch.randn(2, 16))
    assert ir.num_markers == 2
    with_markers = ir.graph_with_markers()
    _C.check_graph(with_markers)
    assert len(with_markers) == len(ir.graph) + 2
    assert sum(n.kind == K.MARKER for n in with_markers.nodes) == 2


@pytest.mark.parametrize("path,fqn", [
    ("L['self'].blocks.0.ln1", "blocks.0.ln1"),
    ("L['self']._modules['layers']._modules['3'].attn", "layers.3.attn"),
    ("L['self'].layers[2]", "layers.2"),
    ("G['model'].encoder", "encoder"),
    ("L['self']", ""),
])
def test_dynamo_module_paths_become_plain_fqns(path, fqn):
    assert module_path_to_fqn(path) == fqn


def test_split_points_resolve_to_the_first_compute_node_inside_the_module():
    cap, ir = captured_ir(models.CharGPT(n_layer=3), torch.randint(0, 32, (2, 8)))
    (start,) = resolve_split_points(ir, ["blocks.1"])
    node = ir.graph.node(start)
    assert node.kind == K.COMPUTE and node.module_fqn == "blocks.1.ln1"
    assert all(not n.module_fqn.startswith("blocks.1") for n in ir.graph.nodes[:start])


def test_in_place_mutation_becomes_a_dependency_of_later_readers():
    class Mutating(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            mask = torch.ones(4, 4)
            mask.triu_(1)                 # in place on a Constant
            h = self.a(x)
            h[:, 0] = 0                   # setitem on a Compute value
            return h @ mask + h

    model = Mutating()
    x = torch.randn(2, 4)
    cap, ir = captured_ir(model, x)
    nodes = ir.graph.nodes
    matmul = next(n for n in nodes if "matmul" in n.target)
    reads = [nodes[i] for i in matmul.inputs]
    assert {n.target.rsplit(".", 1)[-1] for n in reads} == {"after"}
    # The mutated constant stays a Constant (recomputed with its mutation on each stage).
    assert next(n for n in nodes if n.target.endswith("triu_")).kind == K.CONSTANT
    torch.testing.assert_close(cap.gm(*[
        dict(model.named_parameters()).get(p.name, x) for p in cap.placeholders])[0], model(x))


def test_ops_inside_a_no_grad_block_are_captured_with_grad_mode_switches():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv", torch.arange(1.0, 5.0), persistent=False)

        @torch.no_grad()
        def forward(self, x):
            return torch.cos(x[..., None] * self.inv)

    cap = capture(Rotary(), (torch.randn(2, 3),), {})
    assert sum(n.target is torch._C._set_grad_enabled for n in cap.gm.graph.nodes) == 2
    assert inspect.isfunction(mpmd.split_model)


@pytest.mark.parametrize("make, where", [
    (models.BoundaryInCond, r"torch.cond body 'cond_true_0'"),
    (models.BoundaryInCheckpoint, r"torch.utils.checkpoint body 'wrap_body_0'"),
])
def test_marker_inside_a_higher_order_op_body_is_a_capture_error_naming_the_body(make, where):
    # It used to be dropped silently, leaving one stage.
    with pytest.raises(CaptureError, match=r"stage_boundary\(\) inside the " + where +
                       r".*put the boundary outside it"):
        mpmd.split_model(make(), torch.randn(2, 8))


def test_split_point_on_a_checkpointed_layer_starts_a_stage_there():
    sm = mpmd.split_model(models.CheckpointedLayers(), torch.randn(2, 8),
                          split_points=["layers.2"])
    assert sm.num_stages == 2
    starts = resolve_split_points(sm.ir, ["layers.2"])
    assert sm.ir.graph.nodes[starts[0]].module_fqn == "layers.2"
