"""Pipeline API in one process (world size 1: every stage local): parameters
and state dicts under original FQNs, re-capture on a new batch shape,
Replicate, loss_fn=None, schedules from objects and files, forward-only calls."""

import copy
import datetime

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import models
import torch_mpmd as mpmd
from torch_mpmd import schedules

TOL = dict(rtol=1e-5, atol=1e-6)



def gpt_and_batch(batch: int = 8):
    torch.manual_seed(0)
    model = models.CharGPT(vocab=32, d=16, n_layer=2, n_head=2, block_size=8)
    x = torch.randint(0, 32, (batch, 8))
    y = torch.randint(0, 32, (batch, 8))
    return model, x, y


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def reference_grads(model, x, y):
    ref = copy.deepcopy(model)
    loss = lm_loss(ref(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def test_parameters_are_the_modules_own_tensors_before_and_after_capture():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2, split_points=["blocks.1"],
                         schedule="gpipe", stages_per_rank=2)
    own = dict(model.named_parameters())
    assert dict(pipe.named_parameters()) == own  # before capture: the whole module
    pipe.step(x, target=y)
    after = dict(pipe.named_parameters())
    assert after.keys() == own.keys()
    assert all(after[n] is own[n] for n in own)
    assert pipe.state_dict().keys() == model.state_dict().keys()  # tied alias lm_head.weight too


def test_load_state_dict_writes_into_the_stages():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2)
    pipe.step(x, target=y)
    other, _, _ = gpt_and_batch()
    for p in other.parameters():
        torch.nn.init.normal_(p)
    pipe.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert_close(pipe(x), other(x), **TOL)


def test_load_state_dict_with_assign_after_capture_is_refused_naming_it():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2)
    pipe.step(x, target=y)
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    with pytest.raises(ValueError, match=r"assign=True.*captured"):
        pipe.load_state_dict(copy.deepcopy(model).state_dict(), assign=True)
    for n, p in pipe.named_parameters():
        assert torch.equal(p, before[n]), n


def test_new_batch_shape_is_recaptured_and_still_matches_reference():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2, split_points=["blocks.1"],
                         schedule="interleaved_1f1b")
    pipe.step(x, target=y)
    first = pipe.schedule
    x2, y2 = x[:4], y[:4]
    model.zero_grad()
    loss = pipe.step(x2, target=y2)
    ref_loss, ref = reference_grads(model, x2, y2)
    assert_close(loss, ref_loss, **TOL)
    for n, p in pipe.named_parameters():
        assert_close(p.grad, ref[n], **TOL, msg=n)
    assert pipe.schedule is not first


def test_replicated_argument_goes_whole_to_every_microbatch():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 1)

        def forward(self, x, scale):
            return self.b(torch.tanh(self.a(x)) * scale)

    torch.manual_seed(0)
    model = Scaled()
    x, scale, y = torch.randn(8, 4), torch.randn(4), torch.randn(8, 1)
    pipe = mpmd.pipeline(copy.deepcopy(model), loss_fn=F.mse_loss, num_microbatches=4,
                         split_points=["b"], schedule="gpipe", stages_per_rank=2)
    loss = pipe.step(x, mpmd.Replicate(scale), target=y)
    assert_close(loss, F.mse_loss(model(x, scale), y), **TOL)
    with pytest.raises(ValueError, match="0-dim tensor"):
        pipe.step(x, torch.tensor(2.0), target=y)


def test_loss_fn_none_takes_the_models_scalar_output():
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            return F.mse_loss(self.b(torch.relu(self.a(x))), y)

    torch.manual_seed(0)
    model = WithLoss()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    pipe = mpmd.pipeline(copy.deepcopy(model), num_microbatches=2, split_points=["b"],
                         schedule="gpipe", stages_per_rank=2)
    assert_close(pipe.step(x, y), model(x, y), **TOL)
    bad = mpmd.pipeline(models.MLP(d=4, depth=2, markers=False), num_microbatches=2)
    with pytest.raises(mpmd.PipelineError, match="loss as a scalar") as info:
        bad.step(torch.randn(8, 4))
    assert isinstance(info.value.__cause__, ValueError)
    # The cause keeps its traceback (where the stage's runner raised it).
    import traceback
    frames = traceback.extract_tb(info.value.__cause__.__traceback__)
    assert any(f.filename.endswith("runner.py") for f in frames)
    with pytest.raises(RuntimeError, match="no completed step"):
        bad.timelines()  # the failed step left no timeline to gather


def test_schedule_object_and_text_file_give_the_named_schedules_result(tmp_path):
    model, x, y = gpt_and_batch()
    ref_loss, ref = reference_grads(model, x, y)
    sched = schedules.get_schedule("zbv", num_ranks=1, num_microbatches=4,
                                   stages_per_rank=2)
    path = tmp_path / "zbv.txt"
    path.write_text(sched.to_text())
    for given in (sched, str(path)):
        m = copy.deepcopy(model)
        pipe = mpmd.pipeline(m, loss_fn=lm_loss, schedule=given, num_microbatches=4,
                             split_points=["blocks.1"], timeout=datetime.timedelta(seconds=30))
        assert_close(pipe.step(x, target=y), ref_loss, **TOL)
        for n, p in pipe.named_parameters():
            assert_close(p.grad, ref[n], **TOL, msg=n)


def test_forward_only_call_returns_the_models_output():
    model, x, _ = gpt_and_batch()
    pipe = mpmd.pipeline(copy.deepcopy(model), loss_fn=lm_loss, num_microbatches=4,
                         split_points=["blocks.1"], schedule="zbv")
    with torch.no_grad():
        assert_close(pipe(x), model(x), **TOL)


def test_executor_stats_count_live_forwards_within_the_schedules_bound():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=8, split_points=["blocks.1"],
                         schedule="gpipe", stages_per_rank=2)
    pipe.step(x, target=y)
    assert (pipe.last_step_stats["kind"], pipe.last_step_stats["step"]) == ("step", 0)
    assert pipe.last_step_stats["peak_live_forwards"] == pipe.schedule.simulate().peak_activations[0]


def test_step_trace_covers_every_action_and_exports_chrome_json_and_png(tmp_path, monkeypatch):
    import json

    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=4, split_points=["blocks.1"],
                         schedule="zbv")
    monkeypatch.setenv("MPMD_TRACE", str(tmp_path / "env.json"))
    pipe.step(x, target=y)
    stats = pipe.last_step_stats
    assert 0.0 <= stats["bubble_fraction"] < 1.0 and stats["compute_s"] <= stats["span_s"]
    assert set(stats["peak_activation_bytes"]) == {0, 1}
    assert all(b > 0 for b in stats["peak_activation_bytes"].values())
    # The rank's peak over both its stages at once: at least either's, at most both.
    peaks = stats["peak_activation_bytes"].values()
    assert max(peaks) <= stats["peak_held_bytes"] <= sum(peaks), stats
    (row,) = pipe.timelines()
    assert [t for t, _, _ in row] == pipe.schedule.actions[0]
    assert all(s <= e for _, s, e in row)
    assert all(a[2] <= b[1] for a, b in zip(row, row[1:]))  # one action at a time, in order
    events = json.loads((tmp_path / "env.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == pipe.schedule.action_text[0]
    assert {e["cat"] for e in spans} >= {"F", "I", "W"}
    pipe.save_timeline(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_activation_bytes_follow_the_schedules_live_forwards():
    model, x, y = gpt_and_batch()
    peaks = {}
    for name in ("gpipe", "1f1b"):
        pipe = mpmd.pipeline(copy.deepcopy(model), loss_fn=lm_loss, num_microbatches=8,
                             schedule=name)
        pipe.step(x, target=y)
        peaks[name] = pipe.last_step_stats["peak_activation_bytes"][0]
        assert pipe.last_step_stats["peak_held_bytes"] == peaks[name]  # the one stage's
    # One stage on one rank: GPipe holds all 8 forwards, 1F1B one at a time.
    assert peaks["gpipe"] > 6 * peaks["1f1b"]


def test_bubble_fractions_measure_every_rank_against_the_whole_step():
    from torch_mpmd.schedules import Action
    from torch_mpmd.trace import bubble_fractions, step_metrics

    # Rank 1 starts late and ends early: idle for 3 of the step's 10 s (and in
    # between it waits 1 s on a receive, which counts as bubble too).
    rows = [[(Action.parse(t), s, e) for t, s, e in row] for row in [
        [("0F0", 0.0, 4.0), ("0SEND_F0", 4.0, 4.5), ("0B0", 6.0, 10.0)],
        [("1RECV_F0", 2.0, 4.5), ("1F0", 4.5, 5.5), ("1B0", 5.5, 7.0)]]]
    assert bubble_fractions(rows) == pytest.approx([0.2, 0.75])
    # Against its own span (2..7 s) rank 1 idles for 2.5 of 5 s.
    assert step_metrics(rows[1])["bubble_fraction"] == pytest.approx(0.5)
    assert bubble_fractions([[], []]) == [0.0, 0.0]


@pytest.mark.parametrize("hooked", [False, True])
def test_zero_bubble_weight_split_with_tied_weights_matches_reference(hooked):
    # One stage reads the tied embedding twice (embedding and head): W sums both
    # readers' formula contributions; with a hook on it, W re-walks the stage
    # so the hook sees the whole gradient once per microbatch.
    model, x, y = gpt_and_batch()
    loss_ref, grads = reference_grads(model, x, y)
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=4, schedule="zero_bubble")
    calls = []
    if hooked:
        tied = model.wte.weight
        tied.register_hook(lambda g: calls.append(1))
    loss = pipe.step(x, target=y)
    assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for n, p in pipe.named_parameters():
        assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)
    assert len(calls) == (4 if hooked else 0)
    stage = pipe.inspect().runner.stages[0]
    assert stage.wplan is not None and any(w.shared for w in stage.wplan.nodes)


def test_transfer_latencies_match_each_send_to_its_receive():
    from torch_mpmd.schedules import Action
    from torch_mpmd.trace import transfer_latencies

    rows = [[(Action.parse(t), s, e) for t, s, e in row] for row in [
        [("0F0", 0.0, 1.0), ("0SEND_F0", 1.0, 1.1), ("0RECV_B0", 1.1, 5.0),
         ("0SEND_F1->2", 5.0, 5.1)],
        [("1RECV_F0", 0.5, 1.4), ("1F0", 1.4, 2.0), ("1SEND_B0", 3.0, 3.1)],
        [("2RECV_F1<-0", 6.0, 6.2)]]]
    # F0 0->1: waited since 0.5, sent at 1.0, arrived 1.4; B0 1->0: sent at 3.0,
    # arrived 5.0; F1 0->2: the receiver came late (6.0 > 5.0), not a latency.
    assert sorted(transfer_latencies(rows)) == pytest.approx([0.4, 2.0])


def test_action_overhead_is_the_gaps_and_send_postings_per_action():
    from torch_mpmd.schedules import Action
    from torch_mpmd.trace import action_overhead

    rows = [[(Action.parse(t), s, e) for t, s, e in row] for row in [
        [("0F0", 0.0, 1.0), ("0SEND_F0", 1.1, 1.2), ("0RECV_B0", 1.3, 5.0),
         ("0B0", 5.1, 7.0)],
        [("1RECV_F0", 0.0, 1.4), ("1F0", 1.5, 2.0), ("1B0", 2.1, 4.0),
         ("1SEND_B0", 4.1, 4.2), ("1F1", 90.0, 91.0)]]]
    # Gaps 0.1 each (six), the 85.8 before 1F1 left out (another call); SEND
    # postings 0.1 + 0.1; nine actions.
    assert action_overhead(rows) == pytest.approx((6 * 0.1 + 0.2) / 9)
    assert action_overhead([]) == 0.0


def test_only_stages_that_draw_random_numbers_are_reseeded():
    # Dropout stages (their forward program has random ops) are reseeded per
    # (step, stage, microbatch): step 1 of a pipeline equals step 1 of another
    # that starts there. A GPT without dropout draws nothing and is never
    # reseeded.
    torch.manual_seed(0)
    model = models.DropoutMLP(d=8)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def pipe_of(m):
        return mpmd.pipeline(copy.deepcopy(m), loss_fn=F.mse_loss, num_microbatches=4,
                             schedule="gpipe", stages_per_rank=2, seed=7)

    a, b = pipe_of(model), pipe_of(model)
    a.step(x, target=y)   # step 0
    b.step_count = 1      # b starts at step 1
    losses = [float(p.step(x, target=y)) for p in (a, b)]
    assert losses[0] == losses[1]
    assert {s: p.draws_rng for s, p in a.inspect().programs.items()} == {0: True, 1: True}
    gpt, gx, gy = gpt_and_batch()
    g = mpmd.pipeline(gpt, loss_fn=lm_loss, num_microbatches=4)
    g.step(gx, target=gy)
    assert {s: p.draws_rng for s, p in g.inspect().programs.items()} == {0: False}


def test_compute_actions_carry_profiler_labels():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2, schedule="zero_bubble")
    pipe.step(x, target=y)  # capture outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, target=y)
    names = {e.name for e in prof.events() if e.name.startswith("mpmd ")}
    assert names == {f"mpmd 0{k}{mb}" for k in "FIW" for mb in range(2)}


def test_tensor_default_arguments_go_whole_to_every_microbatch():
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, scale=torch.tensor([2.0, 1.0, 0.5, 1.0])):
            return self.fc(x) * scale

    torch.manual_seed(0)
    model = Scaled()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    ref = copy.deepcopy(model)
    loss_ref = F.mse_loss(ref(x), y)
    loss_ref.backward()
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=4)
    assert_close(pipe.step(x, target=y), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert_close(pipe(x), ref(x), rtol=1e-5, atol=1e-6)


def test_a_new_input_shape_captures_again_with_a_log_line_saying_why(caplog):
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2, split_points=["blocks.1"],
                         schedule="gpipe", stages_per_rank=2)
    pipe.step(x, target=y)
    assert not [r for r in caplog.records if "capturing" in r.getMessage()]
    with caplog.at_level("WARNING", logger="torch_mpmd"):
        pipe.step(x[:, :-2], target=y[:, :-2])
    (record,) = [r for r in caplog.records if "capturing" in r.getMessage()]
    message = record.getMessage()
    assert f"{(x.shape[0] // 2, x.shape[1])}" in message  # the old microbatch shape
    assert f"{(x.shape[0] // 2, x.shape[1] - 2)}" in message  # the new one


def test_describe_lists_every_stage_with_its_traffic():
    model, x, y = gpt_and_batch()
    pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2, split_points=["blocks.1"],
                         schedule="gpipe", stages_per_rank=2)
    with pytest.raises(RuntimeError, match="not captured"):
        pipe.describe()
    pipe.step(x, target=y)
    text = pipe.describe()
    assert "stage 0" in text and "stage 1" in text and "sent" in text
