"""torch.compile(model, backend="mpmd"): registration and the world-size-1 pipeline."""

import copy
import logging
import re
import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import models
from torch_mpmd.compile.backend import BACKEND_OPTIONS, check_stage_count, mpmd_backend

TOL = dict(rtol=1e-6, atol=1e-6)



def spy_backend(record):
    """A backend that delegates to mpmd_backend and keeps what it returns."""

    def backend(gm, example_inputs, **kwargs):
        fn = mpmd_backend(gm, example_inputs, **kwargs)
        record.append(fn)
        return fn

    return backend


def assert_compiled_matches_eager(make, args, kwargs=None, options=None, backend="mpmd"):
    kwargs = kwargs or {}
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, options=options)
    for _ in range(2):  # the second call reuses the compiled stages
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        expected = eager(*args, **kwargs)
        got = compiled(*args, **kwargs)
        assert_close(got, expected, **TOL)
        loss = lambda out: sum(t.square().mean() for t in  # noqa: E731
                               torch.utils._pytree.tree_leaves(out))
        loss(expected).backward()
        loss(got).backward()
        ref = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m: f"{name}: {m}")
    return model


def test_mpmd_backend_is_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "mpmd"]
    assert ep.value == "torch_mpmd.compile.backend:mpmd_backend"
    assert "mpmd" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("mpmd") is mpmd_backend


def test_compile_with_split_points_matches_eager_outputs_and_gradients():
    record = []
    assert_compiled_matches_eager(models.CharGPT, (torch.randint(0, 32, (2, 16)),),
                                  options={"split_points": ["blocks.1", "blocks.3"]},
                                  backend=spy_backend(record))
    assert len(record) == 1 and record[0].plan.num_stages == 3


def test_compile_with_split_points_through_the_registered_name():
    assert_compiled_matches_eager(models.CharGPT, (torch.randint(0, 32, (2, 16)),),
                                  options={"split_points": ["blocks.2"]})


def test_compile_with_markers_and_no_options():
    record = []
    assert_compiled_matches_eager(models.SkipNet, (torch.randn(3, 16),),
                                  backend=spy_backend(record))
    assert record[0].plan.num_stages == 4


def test_compile_with_balanced_stages_updates_batchnorm_buffers_like_eager():
    model = assert_compiled_matches_eager(models.ResCNN, (torch.randn(2, 3, 8, 8),),
                                          options={"num_stages": 2})
    assert int(model.stem[1].num_batches_tracked) == 2


def test_compile_with_keyword_attention_mask_and_stages_per_rank():
    record = []
    args = (torch.randint(0, 20, (2, 5)), torch.randn(2, 5, 6))
    kwargs = {"attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), "scale": 0.5}
    assert_compiled_matches_eager(models.MultiInputAttention, args, kwargs,
                                  options={"stages_per_rank": 3, "num_microbatches": 2},
                                  backend=spy_backend(record))
    assert record[0].plan.num_stages == 3


def test_backend_stage_modules_hold_parameters_under_original_fqns():
    record = []
    model = models.CharGPT(n_layer=2)
    torch.compile(model, backend=spy_backend(record),
                  options={"split_points": ["blocks.1"]})(torch.randint(0, 32, (2, 8)))
    (fn,) = record
    params = dict(model.named_parameters())
    names = set()
    for stage in fn.stages:
        for name, p in stage.named_parameters():
            assert p is params[name]
            names.add(name)
    assert names == set(params)
    assert [p.fqn for p in fn.plan.parameters if p.shared] == ["wte.weight"]


def test_replacing_a_parameter_after_compiling_is_seen_by_the_stages():
    torch.manual_seed(0)
    model = models.MLP(markers=False)
    compiled = torch.compile(model, backend="mpmd", options={"num_stages": 2})
    x = torch.randn(4, 16)
    compiled(x)
    model.head.weight = nn.Parameter(torch.randn_like(model.head.weight))
    assert_close(compiled(x), model(x), **TOL)


def test_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'splitpoints'.*known options: .*split_points"):
        mpmd_backend(None, [], options={"splitpoints": ["blocks.1"]})
    compiled = torch.compile(models.MLP(), backend="mpmd", options={"splitpoints": ["x"]})
    with pytest.raises(Exception) as info:  # Dynamo wraps it in BackendCompilerFailed
        compiled(torch.randn(2, 16))
    inner = getattr(info.value, "inner_exception", info.value)
    assert isinstance(inner, ValueError) and "'splitpoints'" in str(inner)
    assert set(BACKEND_OPTIONS) >= {"split_points", "num_stages", "num_microbatches",
                                    "stages_per_rank"}


def test_num_stages_and_stages_per_rank_that_disagree_name_both():
    with pytest.raises(ValueError, match="stages_per_rank=2 disagrees with the 3 stages"):
        gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
        mpmd_backend(gm, [], options={"num_stages": 3, "stages_per_rank": 2})


def test_bad_option_values_are_value_errors():
    with pytest.raises(ValueError, match="num_microbatches=0"):
        mpmd_backend(None, [], options={"num_microbatches": 0})
    with pytest.raises(ValueError, match="split_points='blocks.1'"):
        mpmd_backend(None, [], options={"split_points": "blocks.1"})


def test_graph_break_is_an_error_naming_the_source_line():
    compiled = torch.compile(models.DataDependentBranch(), backend="mpmd")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 8))
    inner = getattr(info.value, "inner_exception", info.value)
    assert isinstance(inner, ValueError)
    assert re.search(r"models\.py:\d+ \(`if x\.sum\(\) > 0", str(inner)), str(inner)


def test_hugging_face_gpt2_compiles_with_split_points_and_matches_eager():
    import transformers
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 64, (2, 12))
    record = []
    compiled = torch.compile(model, backend=spy_backend(record),
                             options={"split_points": ["transformer.h.2"]})
    # HF logs a warning inside forward; Dynamo breaks graphs at logging calls.
    ignore = torch._dynamo.config.ignore_logging_functions | {logging.Logger.warning_once}
    with torch._dynamo.config.patch(ignore_logging_functions=ignore):
        # A KV cache is not a pytree: the pipelined call returns no cache.
        got = compiled(ids, labels=ids, use_cache=False)
    expected = eager(ids, labels=ids, use_cache=False)
    assert record[0].plan.num_stages == 2
    assert_close(got.logits, expected.logits, **TOL)
    got.loss.backward()
    expected.loss.backward()
    ref = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-6)


def test_stage_count_must_fit_the_pipeline_size_naming_the_values():
    assert check_stage_count(8, 4) == 2
    assert check_stage_count(4, 2, stages_per_rank=2) == 2
    with pytest.raises(ValueError, match="define 3 stages, which is not a multiple of the "
                                         "pipeline size pp_size=2"):
        check_stage_count(3, 2)
    with pytest.raises(ValueError, match="stages_per_rank=1 disagrees with the 4 stages .* "
                                         "pp_size=2 ranks \\(2 per rank\\)"):
        check_stage_count(4, 2, stages_per_rank=1)


def test_global_tensor_and_argument_with_the_same_stripped_name_are_distinct_inputs():
    # Dynamo names them G_x_ and L_x_; both used to become input "x", and the
    # global was fed to both placeholders. Placeholders are now told apart by
    # identity: the argument is an input, the global a (non-persistent) buffer.
    record = []
    assert_compiled_matches_eager(models.GlobalTensorAndInput, (torch.randn(2, 8),),
                                  backend=spy_backend(record))
    names = [n for sig in record[0].stage_signatures for n in sig.user_inputs]
    assert names == ["x_"]  # the global tensor is a constant of the stage, not an input
    assert any("x" in sig.buffers for sig in record[0].stage_signatures)


def test_marker_inside_a_checkpoint_body_is_an_error_naming_it():
    compiled = torch.compile(models.BoundaryInCheckpoint(), backend="mpmd")
    with pytest.raises(Exception, match=r"stage_boundary\(\) inside the torch.utils.checkpoint "
                                        r"body 'wrap_body_0'.*outside it"):
        compiled(torch.randn(2, 8))


def test_compile_with_split_points_on_checkpointed_layers():
    record = []
    assert_compiled_matches_eager(models.CheckpointedLayers, (torch.randn(2, 8),),
                                  options={"split_points": ["layers.2"]},
                                  backend=spy_backend(record))
    assert record[0].plan.num_stages == 2
