"""split_model: stage modules built from the C++ plan reproduce the model, single process."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.testing import assert_close

import models
import torch_mpmd as mpmd
from torch_mpmd import _C
from torch_mpmd.graph.stage import StageSignature, partition

TOL = dict(rtol=1e-6, atol=1e-6)


def scalar_loss(out):
    return sum(t.float().square().mean() for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def assert_split_reproduces(make, args, kwargs=None, tol=TOL, **split):
    """Split a copy of the model; chaining its stages gives the plain model's
    outputs, parameter gradients and buffers. Returns the SplitModel."""
    kwargs = kwargs or {}
    torch.manual_seed(0)
    reference = make()
    model = copy.deepcopy(reference)
    sm = mpmd.split_model(model, *args, **split, **kwargs)
    expected = reference(*args, **kwargs)
    got = sm.run(*args, **kwargs)
    assert_close(got, expected, **tol)
    scalar_loss(expected).backward()
    scalar_loss(got).backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert_close(p.grad, ref_params[name].grad, **tol, msg=lambda m: f"{name}: {m}")
    ref_buffers = dict(reference.named_buffers())
    for name, b in model.named_buffers():
        assert_close(b, ref_buffers[name], **tol, msg=lambda m: f"buffer {name}: {m}")
    return sm


def gpt_input():
    return (torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1)),)


MULTI_ARGS = (torch.randint(0, 20, (2, 5)), torch.randn(2, 5, 6))
MULTI_KWARGS = {"attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
                "scale": 0.5}

ZOO = {
    "mlp-markers": (models.MLP, (torch.randn(4, 16),), {}, {}),
    "mlp-split-points": (lambda: models.MLP(markers=False), (torch.randn(4, 16),), {},
                         {"split_points": ["blocks.1", "blocks.3"]}),
    "mlp-balanced": (lambda: models.MLP(markers=False), (torch.randn(4, 16),), {},
                     {"num_stages": 3}),
    "gpt-split-points": (models.CharGPT, gpt_input(), {},
                         {"split_points": ["blocks.1", "blocks.2", "blocks.3"]}),
    "gpt-balanced": (models.CharGPT, gpt_input(), {}, {"num_stages": 3}),
    "cnn-split-points": (models.ResCNN, (torch.randn(2, 3, 8, 8),), {},
                         {"split_points": ["layers.1", "layers.2"]}),
    "cnn-balanced": (models.ResCNN, (torch.randn(2, 3, 8, 8),), {}, {"num_stages": 2}),
    "skip-markers": (models.SkipNet, (torch.randn(3, 16),), {}, {}),
    "multi-input-split-points": (models.MultiInputAttention, MULTI_ARGS, MULTI_KWARGS,
                                 {"split_points": ["layers.1", "layers.2"]}),
    "multi-input-balanced": (models.MultiInputAttention, MULTI_ARGS, MULTI_KWARGS,
                             {"num_stages": 2}),
}


@pytest.mark.parametrize("case", sorted(ZOO))
def test_chained_stages_reproduce_outputs_gradients_and_buffers(case):
    make, args, kwargs, split = ZOO[case]
    sm = assert_split_reproduces(make, args, kwargs, **split)
    expected = split.get("num_stages") or len(split.get("split_points", [])) + 1
    if case.endswith("markers"):
        expected = {"mlp-markers": 4, "skip-markers": 4}[case]
    assert sm.num_stages == expected == len(sm.stages) == len(sm.stage_signatures)


def test_markers_and_split_points_at_the_same_boundaries_give_the_same_plan_hash():
    torch.manual_seed(0)
    marked = models.MLP(markers=True)
    unmarked = models.MLP(markers=False)
    x = torch.randn(4, 16)
    a = mpmd.split_model(marked, x)
    b = mpmd.split_model(unmarked, x, split_points=["blocks.1", "blocks.2", "blocks.3"])
    c = mpmd.split_model(unmarked, x, split_points=["blocks.1", "blocks.3"])
    assert a.plan.hash == b.plan.hash != c.plan.hash
    assert a.plan.node_stage == b.plan.node_stage


def test_tied_embedding_and_unembedding_are_one_parameter_marked_shared():
    sm = mpmd.split_model(models.CharGPT(), *gpt_input(), split_points=["blocks.2"])
    placement = {p.fqn: p for p in sm.plan.parameters}
    assert "lm_head.weight" not in placement
    tied = placement["wte.weight"]
    assert tied.shared and tied.stages == [0, 1]
    assert [p.fqn for p in sm.plan.parameters if p.shared] == ["wte.weight"]
    assert sm.parameter_aliases == {"wte.weight": ("lm_head.weight",)}
    assert sm.stage_of_parameter("lm_head.weight") == [0, 1]
    first, last = (dict(s.named_parameters())["wte.weight"] for s in sm.stages)
    assert first is last


def test_stage_parameters_keep_original_fqns_and_are_the_models_tensors():
    model = models.ResCNN()
    sm = mpmd.split_model(model, torch.randn(2, 3, 8, 8), split_points=["layers.1", "fc"])
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    seen_params, seen_buffers = set(), set()
    for stage, sig in zip(sm.stages, sm.stage_signatures):
        for name, p in stage.named_parameters():
            assert p is params[name]
            seen_params.add(name)
        for name, b in stage.named_buffers():
            assert b is buffers[name]
            seen_buffers.add(name)
        assert set(sig.parameters) == {n for n, _ in stage.named_parameters()}
        assert set(sig.buffers) == {n for n, _ in stage.named_buffers()}
    assert seen_params == set(params) and seen_buffers == set(buffers)
    assert "layers.0.conv1.weight" in dict(sm.stages[0].named_parameters())
    assert "fc.weight" in dict(sm.stages[2].named_parameters())
    assert set(sm.stages[2].state_dict()) == {"fc.weight", "fc.bias"}


def test_skip_connection_value_is_sent_once_to_every_later_stage_that_reads_it():
    sm = mpmd.split_model(models.SkipNet(), torch.randn(3, 16))
    crossing = {sm.ir.fx_nodes[v.node].name: v for v in sm.plan.cross_stage_values}
    assert crossing["h0"].producer_stage == 0 and crossing["h0"].consumer_stages == [1, 2, 3]
    assert crossing["h1"].consumer_stages == [2, 3]  # read by stage 2 and returned at the end
    sig0, _, sig2, sig3 = sm.stage_signatures
    assert [v.name for v in sig0.sent] == ["h0"]
    assert [v.name for v in sig2.received] == ["h0", "h1"]
    assert sig3.input_names == ("h0", "h1", "h2") and sig3.num_model_outputs == 2


def test_stage_signatures_list_user_inputs_received_and_sent_values():
    sm = mpmd.split_model(models.MultiInputAttention(), *MULTI_ARGS,
                          split_points=["layers.1"], **MULTI_KWARGS)
    first, last = sm.stage_signatures
    assert isinstance(first, StageSignature)
    assert set(first.user_inputs) == {"tokens", "features", "attention_mask"}
    assert first.num_model_outputs == 0 and last.num_model_outputs == 2
    assert [v.name for v in last.received] == [v.name for v in first.sent]
    assert last.output_names == ("output[0]", "output[1]")
    # The stage modules take exactly the signature's inputs.
    import inspect
    for stage, sig in zip(sm.stages, sm.stage_signatures):
        assert len(inspect.signature(stage.forward).parameters) == len(sig.input_names)
    text = sm.describe()
    assert "stage 0: inputs (" in text and "hash" in text


def test_constants_are_recomputed_on_every_stage_that_reads_them():
    sm = mpmd.split_model(models.CharGPT(), *gpt_input(), split_points=["blocks.2"])
    replicated = [sm.ir.fx_nodes[i].name for i, st in enumerate(sm.plan.constant_stages)
                  if list(st) == [0, 1]]
    assert replicated, "the causal mask is built in every block: both stages rebuild it"
    assert not any(sm.ir.fx_nodes[v.node].name in replicated
                   for v in sm.plan.cross_stage_values)


def test_batchnorm_running_stats_update_the_models_own_buffers():
    model = models.ResCNN()
    sm = mpmd.split_model(model, torch.randn(2, 3, 8, 8), split_points=["layers.1"])
    assert int(model.stem[1].num_batches_tracked) == 0  # capture runs nothing
    before = model.layers[2].bn2.running_mean.clone()
    sm.run(torch.randn(2, 3, 8, 8))
    assert int(model.stem[1].num_batches_tracked) == 1
    assert not torch.equal(model.layers[2].bn2.running_mean, before)


class InPlaceAcrossStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        mpmd.stage_boundary()
        g = torch.sigmoid(h)
        h.mul_(2)                 # mutates a value produced on stage 0
        mpmd.stage_boundary()
        return self.b(h) + g


def test_in_place_mutation_of_a_received_value_reaches_later_stages():
    sm = assert_split_reproduces(InPlaceAcrossStages, (torch.randn(2, 8),))
    last = sm.stage_signatures[2]
    # Stage 2 reads the mutated h from stage 1 (not the pre-mutation h of stage 0).
    assert all(v.producer_stage == 1 for v in last.received)


def test_view_of_a_constant_taken_before_an_in_place_write_sees_the_write():
    sm = assert_split_reproduces(models.ViewOfConstantBeforeWrite, (torch.randn(2, 4),))
    # The written buffer and its views are not Constants rebuilt from zeros on stage 1.
    names = {sm.ir.fx_nodes[i].name for i, st in enumerate(sm.plan.constant_stages)
             if len(st) > 0}
    assert not names & {"buf", "head", "tail"}
    assert all(v.producer_stage == 0 for v in sm.stage_signatures[1].received)


def test_view_of_a_value_taken_before_an_in_place_write_on_a_later_stage():
    sm = assert_split_reproduces(models.ViewOfValueBeforeWrite, (torch.randn(2, 4),))
    # The view's later reader depends on the write (reads after(v, mul_)).
    nodes = sm.ir.graph.nodes
    reader = next(n for n in nodes if n.target.endswith("sum"))
    assert [nodes[i].target.rsplit(".", 1)[-1] for i in reader.inputs] == ["after"]
    assert "mul_" in {nodes[j].name for j in nodes[reader.inputs[0]].inputs}


class GradModeSwitches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            scale = self.a(x).abs().mean() + 1
            mpmd.stage_boundary()
            shift = self.b(x).mean()
        return self.a(x) * scale + self.b(x) + shift


def test_no_grad_regions_are_kept_per_stage_and_restored_after_each():
    sm = assert_split_reproduces(GradModeSwitches, (torch.randn(2, 8),))
    assert torch.is_grad_enabled()
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = sm.run(x)
        assert not torch.is_grad_enabled()
    assert not out.requires_grad


def test_balanced_split_of_uneven_layers_is_optimal_for_compute_alone_and_with_traffic():
    sm = mpmd.split_model(models.UnevenLayers(), torch.randn(4, 8), num_stages=3)
    costs = [n.cost for n in sm.ir.graph.nodes if n.kind == _C.NodeKind.COMPUTE]
    # bytes_cost=0: the largest stage's compute is the optimum over contiguous splits.
    compute_only = partition(sm.ir, num_stages=3, bytes_cost=0)
    assert max(compute_only.stage_cost) == pytest.approx(optimal_max_stage_cost(costs, 3))
    assert sum(compute_only.stage_cost) == pytest.approx(sum(costs))
    # The default prices traffic: the plan's objective (compute plus bytes_cost
    # times the bytes crossing each stage's boundaries) is the reference optimum.
    for bytes_cost, plan in ((_C.DEFAULT_BYTES_COST, sm.plan),
                             (3.0, partition(sm.ir, num_stages=3, bytes_cost=3.0))):
        best, cross = optimal_max_stage_cost_with_traffic(sm.ir.graph, 3, bytes_cost)
        assert plan_objective(sm.ir.graph, plan, cross, bytes_cost) == pytest.approx(best)
    assert_split_reproduces(models.UnevenLayers, (torch.randn(4, 8),), num_stages=3)


def optimal_max_stage_cost(costs, k):
    """Reference: min over contiguous k-splits of the largest part (O(n^2 k) DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for parts in range(1, k + 1):
        for end in range(1, n + 1):
            best[parts][end] = min(max(best[parts - 1][start], prefix[end] - prefix[start])
                                   for start in range(parts - 1, end)) if end >= parts else inf
    return best[k][n]


def crossing_bytes(graph):
    """Per cut c (a stage starting at the c-th Compute node), the bytes of
    Compute values made before it and read at or after it (None: none cross)."""
    nodes = graph.nodes
    items = [n.id for n in nodes if n.kind == _C.NodeKind.COMPUTE]
    position = {node_id: k for k, node_id in enumerate(items)}
    last = {}
    for k, node_id in enumerate(items):
        for i in nodes[node_id].inputs:
            if i in position:
                last[i] = max(last.get(i, -1), k)
    for i in nodes[-1].inputs:  # the Output, on the last stage
        if i in position:
            last[i] = len(items) - 1
    cross = [0] * (len(items) + 1)
    for c in range(1, len(items)):
        crossing = [i for i, k in last.items() if position[i] < c <= k]
        cross[c] = sum(nodes[i].output_bytes for i in crossing) if crossing else None
    return cross


def optimal_max_stage_cost_with_traffic(graph, k, bytes_cost):
    """Reference: min over contiguous k-splits at cuts some value crosses of the
    largest (compute + bytes_cost * bytes crossing its two boundaries)."""
    costs = [n.cost for n in graph.nodes if n.kind == _C.NodeKind.COMPUTE]
    cross = crossing_bytes(graph)
    n = len(costs)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for parts in range(1, k + 1):
        for end in range(parts, n + 1):
            if cross[end] is None:
                continue
            for start in range(parts - 1, end):
                if cross[start] is None or best[parts - 1][start] == inf:
                    continue
                stage = sum(costs[start:end]) + bytes_cost * (cross[start] + cross[end])
                best[parts][end] = min(best[parts][end], max(best[parts - 1][start], stage))
    return best[k][n], cross


def plan_objective(graph, plan, cross, bytes_cost):
    stages = [plan.node_stage[n.id] for n in graph.nodes if n.kind == _C.NodeKind.COMPUTE]
    bounds = [0] + [c for c in range(1, len(stages)) if stages[c] != stages[c - 1]] + [len(stages)]
    return max(plan.stage_cost[s] + bytes_cost * (cross[bounds[s]] + cross[bounds[s + 1]])
               for s in range(plan.num_stages))


def test_balanced_split_of_a_llama_cuts_between_decoder_layers_and_moves_fewer_bytes():
    # With compute alone the cuts fall inside decoder layers, where q/k/v or
    # the MLP's halves cross as well as the residual stream; priced traffic
    # puts every cut between two layers: only the hidden state and the rotary
    # cos/sin cross.
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    sm = mpmd.split_model(transformers.LlamaForCausalLM(config), ids, num_stages=4,
                          use_cache=False)
    nodes = sm.ir.graph.nodes

    def boundaries(plan):
        compute = [n for n in nodes if n.kind == _C.NodeKind.COMPUTE]
        return [(before.module_fqn, after.module_fqn) for before, after in zip(compute, compute[1:])
                if plan.node_stage[before.id] != plan.node_stage[after.id]]

    def sent(plan):
        return sum(v.bytes * len(v.consumer_stages) for v in plan.cross_stage_values)

    assert boundaries(sm.plan) == [(f"model.layers.{i}", f"model.layers.{i + 1}.input_layernorm")
                                   for i in range(3)]
    hidden = 2 * 12 * 32 * 4
    rotary = {nodes[v.node].name: v.bytes for v in sm.plan.cross_stage_values
              if v.consumer_stages == [1, 2, 3]}
    assert len(rotary) == 2 and sum(rotary.values()) == 2 * 12 * 8 * 4  # cos and sin
    assert sent(sm.plan) == 3 * hidden + 3 * sum(rotary.values())

    compute_only = partition(sm.ir, num_stages=4, bytes_cost=0)
    assert any(not after.endswith("input_layernorm") for _, after in boundaries(compute_only))
    assert sent(compute_only) > 2 * sent(sm.plan)
    assert max(compute_only.stage_cost) < max(sm.plan.stage_cost)  # what the traffic buys


def test_balanced_split_of_char_gpt_cuts_between_blocks_and_reproduces_the_model():
    sm = assert_split_reproduces(models.CharGPT, gpt_input(), num_stages=4)
    nodes = sm.ir.graph.nodes
    starts = [next(n for n in nodes if n.kind == _C.NodeKind.COMPUTE
                   and sm.plan.node_stage[n.id] == s).module_fqn for s in range(1, 4)]
    assert starts == ["blocks.1.ln1", "blocks.2.ln1", "blocks.3.ln1"]
    assert [v.bytes for v in sm.plan.cross_stage_values] == [2 * 16 * 32 * 4] * 3


def test_bytes_cost_passes_through_partition_and_is_checked():
    sm = mpmd.split_model(models.CharGPT(), *gpt_input(), num_stages=2)
    default = partition(sm.ir, num_stages=2)
    assert default.hash == sm.plan.hash
    assert partition(sm.ir, num_stages=2, bytes_cost=_C.DEFAULT_BYTES_COST).hash == default.hash
    assert partition(sm.ir, num_stages=2, bytes_cost=0.0).hash != default.hash
    with pytest.raises(ValueError, match=r"bytes_cost=-1 must be finite and >= 0"):
        partition(sm.ir, num_stages=2, bytes_cost=-1.0)


def test_describe_tabulates_compute_parameter_bytes_and_traffic_per_stage():
    sm = mpmd.split_model(models.SkipNet(), torch.randn(3, 16))
    text = sm.describe()
    assert text.startswith("partition plan: 4 stages")
    table = text[text.index("  per stage, per microbatch:\n"):].splitlines()[1:]
    assert table[0].split() == ["stage", "compute", "cost", "parameter", "bytes", "bytes",
                                "sent", "bytes", "received"]
    rows = [line.split() for line in table[1:]]
    value = 3 * 16 * 4  # every crossing value is a 3 x 16 float32 tensor
    # h0 goes from stage 0 to stages 1, 2 and 3; h1 from 1 to 2 and 3; h2 from 2 to 3.
    sent = [3 * value, 2 * value, value, 0]
    received = [0, value, 2 * value, 3 * value]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    for s, row in enumerate(rows):
        assert float(row[1]) == pytest.approx(sm.plan.stage_cost[s], rel=1e-3)
        assert row[2] == f"{(16 * 16 + 16) * 4:,}" == f"{sm.plan.stage_parameter_bytes[s]:,}"
        assert row[3:] == [f"{sent[s]:,}", f"{received[s]:,}"]


# ----------------------------------------------------------------- errors


def test_unknown_split_point_names_it_and_the_closest_modules():
    with pytest.raises(ValueError, match=r"'blocks\.9'.*closest module FQNs: 'blocks\.\d'"):
        mpmd.split_model(models.MLP(markers=False), torch.randn(2, 16), split_points=["blocks.9"])
    with pytest.raises(ValueError, match=r"'block\.1'.*'blocks\.1'"):
        mpmd.split_model(models.MLP(markers=False), torch.randn(2, 16), split_points=["block.1"])


def test_boundary_inside_data_dependent_control_flow_is_a_capture_error_with_file_line():
    with pytest.raises(mpmd.CaptureError, match=r"models\.py:\d+ \(in forward: `if x\.sum"):
        mpmd.split_model(models.DataDependentBranch(), torch.randn(2, 8))


def test_empty_stage_between_adjacent_markers_is_an_error():
    with pytest.raises(ValueError, match="stage 1 has no compute nodes.*adjacent"):
        mpmd.split_model(models.AdjacentMarkers(), torch.randn(2, 8))


def test_split_point_at_the_first_operation_would_leave_stage_zero_empty():
    with pytest.raises(ValueError, match="'blocks.0' begins at the model's first operation"):
        mpmd.split_model(models.MLP(markers=False), torch.randn(2, 16), split_points=["blocks.0"])


def test_boundary_that_no_value_crosses_is_an_error():
    with pytest.raises(ValueError, match="no value crosses the boundary between stage 0 and "
                                         "stage 1"):
        mpmd.split_model(models.IndependentStages(), torch.randn(2, 8))


def test_markers_and_split_points_together_are_an_error():
    with pytest.raises(ValueError, match="stage_boundary.*split_points.*one or the other"):
        mpmd.split_model(models.MLP(), torch.randn(2, 16), split_points=["blocks.1"])


def test_split_points_out_of_program_order_name_both():
    with pytest.raises(ValueError, match="program order: 'blocks.1'.*before 'blocks.2'"):
        mpmd.split_model(models.MLP(markers=False), torch.randn(2, 16),
                         split_points=["blocks.2", "blocks.1"])


def test_num_stages_that_disagrees_with_markers_names_both():
    with pytest.raises(ValueError, match="num_stages=2 disagrees with 3 stage_boundary.*4 stages"):
        mpmd.split_model(models.MLP(), torch.randn(2, 16), num_stages=2)


def test_more_stages_than_compute_nodes_is_an_error():
    with pytest.raises(ValueError, match="num_stages=100"):
        mpmd.split_model(models.MLP(markers=False), torch.randn(2, 16), num_stages=100)


def test_running_with_another_input_shape_is_an_error_naming_the_shapes():
    sm = mpmd.split_model(models.MLP(), torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"'x' had shape \(2, 16\).*got \(3, 16\)"):
        sm.run(torch.randn(3, 16))


def test_switching_train_and_eval_after_splitting_is_an_error():
    model = models.ResCNN()
    sm = mpmd.split_model(model, torch.randn(2, 3, 8, 8), num_stages=2)
    model.eval()
    with pytest.raises(ValueError, match="split in training mode"):
        sm.run(torch.randn(2, 3, 8, 8))


def test_nested_and_variadic_inputs_reach_their_stages_by_name():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, batch, *extra, **options):
            h = self.a(batch["x"])
            mpmd.stage_boundary()
            return {"y": self.b(h) + extra[0] * options["w"]}

    x, e, w = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    sm = assert_split_reproduces(Nested, ({"x": x}, e), {"w": w})
    assert sm.stage_signatures[0].user_inputs == ("batch['x']",)
    assert set(sm.stage_signatures[1].user_inputs) == {"extra[0]", "w"}


def test_changed_non_tensor_input_is_an_error():
    sm = mpmd.split_model(models.MultiInputAttention(), *MULTI_ARGS, **MULTI_KWARGS)
    with pytest.raises(ValueError, match="'scale' was 0.5"):
        sm.run(*MULTI_ARGS, attention_mask=MULTI_KWARGS["attention_mask"], scale=2.0)


# ----------------------------------------------------------------- Hugging Face


def test_hugging_face_gpt2_split_with_split_points_matches_outputs_and_gradients():
    import transformers
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    sm = assert_split_reproduces(
        lambda: transformers.GPT2LMHeadModel(config), (ids,),
        {"labels": labels, "use_cache": False}, tol=dict(rtol=1e-5, atol=1e-6),
        split_points=["transformer.h.1", "transformer.h.3"])
    assert sm.num_stages == 3
    assert {p.fqn for p in sm.plan.parameters if p.shared} == {"transformer.wte.weight"}


def test_hugging_face_llama_split_with_split_points_matches_outputs_and_gradients():
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    # HF takes other code paths when compiled than eagerly (mask and attention
    # dispatch), so gradients agree to fp32 rounding rather than bit for bit.
    sm = assert_split_reproduces(
        lambda: transformers.LlamaForCausalLM(config), (ids,),
        {"labels": labels, "attention_mask": torch.ones_like(ids), "use_cache": False},
        tol=dict(rtol=1e-5, atol=1e-6), split_points=["model.layers.2"])
    assert sm.num_stages == 2


def test_input_and_received_value_with_the_same_name_get_distinct_stage_arguments():
    sm = assert_split_reproduces(models.ReusedArgumentName, (torch.randn(2, 8), torch.randn(2, 8)))
    sig = sm.stage_signatures[1]
    assert sig.input_names == ("mask", "mask")  # the signature keeps the names
    args = [n.target for n in sm.stages[1].graph.nodes if n.op == "placeholder"]
    assert len(set(args)) == 2


def test_inputs_that_differ_from_the_split_call_are_errors_naming_them():
    x = torch.randn(2, 8)
    model = models.OptionalArguments()
    sm = mpmd.split_model(model, x)
    assert_close(sm.run(x), model(x))
    assert_close(sm.run(x, None, 1.0), model(x))  # defaults passed explicitly
    with pytest.raises(ValueError, match="'mask'"):  # left at None when split
        sm.run(x, mask=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="'scale' was 1.0.*got 3.0"):  # default when split
        sm.run(x, scale=3.0)
    sm3 = mpmd.split_model(model, x, scale=3.0)
    with pytest.raises(ValueError, match="'scale' was 3.0.*got 1.0"):  # omitted now
        sm3.run(x)
    smm = mpmd.split_model(model, x, torch.ones(2, 8))
    with pytest.raises(ValueError, match="'mask'"):  # passed when split, omitted now
        smm.run(x)


def test_extra_keyword_input_not_known_from_the_split_call_is_an_error_naming_it():
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x, **extra):
            h = self.a(x)
            mpmd.stage_boundary()
            return self.b(h) + sum(extra.values(), torch.zeros(()))

    x = torch.randn(2, 4)
    sm = mpmd.split_model(Kw(), x)
    with pytest.raises(ValueError, match="'bias'"):
        sm.run(x, bias=torch.ones(2, 4))
