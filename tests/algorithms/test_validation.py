"""Unit tests of the validation rules (agoractl.algorithms.validation): every kind of bad tensor is
rejected with the right reason, valid edge cases pass (legitimately large early losses, the first
samples before any magnitude history, a stage's values drifting within bounds), the refused_outputs
self-termination rule, and the fault drills. In-memory, no network."""

from __future__ import annotations

import math

import pytest
import torch

from agoractl.algorithms.termination import EXIT_CODES, SelfTermination
from agoractl.algorithms.validation import (FaultBook, Invalid, NormTracker, ReplyChecks, check_losses, check_tensor,
                                            loss_bound, part_problem, request_problem, rms_per_sample, update_mask)
from agoractl.manifest.schema import Run
from agoractl.manifest.workers import SelfTermination as SelfTerminationConfig
from agoractl.training.fault_drill import ONSET, corrupt_part, corrupt_results

NAN, INF = float("nan"), float("inf")


def reason(fn, *args, **kwargs) -> str:
    with pytest.raises(Invalid) as e:
        fn(*args, **kwargs)
    return e.value.reason


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_single_non_finite_value_is_rejected_naming_the_count(bad):
    t = torch.randn(2, 8, 4)
    t[1, 3, 2] = bad
    with pytest.raises(Invalid, match=r"1 non-finite value\(s\) \(NaN or inf\) of 64") as e:
        check_tensor("wire", t, (2, 8, 4))
    assert e.value.reason == "non_finite"


def test_shape_dtype_and_missing_tensors_are_rejected():
    assert reason(check_tensor, "wire", torch.zeros(2, 8, 5), (2, 8, 4)) == "shape"
    assert reason(check_tensor, "wire", torch.zeros(2, 8), (2, 8, 4)) == "shape"
    assert reason(check_tensor, "wire", None, (2, 8, 4)) == "shape"
    assert reason(check_tensor, "wire", torch.zeros(2, 8, 4, dtype=torch.float64), (2, 8, 4)) == "dtype"
    check_tensor("wire", torch.zeros(2, 8, 4, dtype=torch.bfloat16), (None, 8, None))  # wildcards, wire dtypes


def test_requests_a_worker_refuses():
    ids = torch.randint(0, 256, (2, 9), dtype=torch.int32)
    wire, grad = torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    assert request_problem("forward", ids, None, None, 256, needs_wire=False) is None
    assert request_problem("backward", ids, wire, grad, 256, needs_wire=True) is None
    assert "non-finite" in request_problem("forward", ids, torch.full_like(wire, NAN), None, 256, needs_wire=True)
    assert "grad holds" in request_problem("backward", ids, wire, torch.full_like(grad, INF), 256, needs_wire=True)
    assert "outside [0, 256)" in request_problem("forward", ids + 300, None, None, 256, needs_wire=False)
    assert "outside [0, 256)" in request_problem("forward", ids - 300, None, None, 256, needs_wire=False)
    edge = ids.clone()
    edge[0, 0], edge[1, -1] = 0, 255  # the first and last ids of the vocabulary pass
    assert request_problem("forward", edge, None, None, 256, needs_wire=False) is None
    assert "wire is missing" in request_problem("forward", ids, None, None, 256, needs_wire=True)
    assert "expected (2, 8, '*')" in request_problem("forward", ids, torch.randn(2, 7, 4), None, 256, needs_wire=True)
    assert "dtype float32" in request_problem("forward", ids.float(), None, None, 256, needs_wire=False)


def test_magnitude_bound_applies_after_warmup_and_is_robust_to_one_outlier():
    tracker = NormTracker(multiple=100, window=16, warmup=4)
    huge = torch.randn(1, 8, 4) * 1e6
    tracker.observe(tracker.check("wire", huge))  # before warmup nothing but finiteness is checked
    for _ in range(4):
        tracker.observe(tracker.check("wire", torch.randn(1, 8, 4)))
    assert tracker.bound() < 1e3  # the median ignores the outlier let in early
    assert reason(tracker.check, "wire", huge) == "magnitude"
    tracker.check("wire", torch.randn(3, 8, 4) * 20)  # a stage's values drifting 20x: still accepted


def test_a_bound_learned_early_survives_values_shrinking_as_the_model_memorises():
    """The false positive of a small corpus's second epoch: the body's input gradients fell from first-epoch
    sizes to an RMS of 0.0017 as the model memorised, and the first sample it had not memorised (0.194)
    was refused as 113 x the median — the only body worker banned. The bound keeps the highest median."""
    tracker = NormTracker(multiple=100, window=64, warmup=8)
    for _ in range(16):  # first epoch: gradients of an unfitted model
        tracker.observe(tracker.check("input gradient", torch.full((1, 8, 4), 0.05)))
    for _ in range(200):  # second epoch: memorised, the window holds nothing but tiny gradients
        tracker.observe(tracker.check("input gradient", torch.full((1, 8, 4), 0.00172)))
    tracker.check("input gradient", torch.full((1, 8, 4), 0.194))  # an honest value of first-epoch size passes
    assert reason(tracker.check, "input gradient", torch.full((1, 8, 4), 0.00172 * 1e6)) == "magnitude"


HONEST_EARLY = [0.00048, 0.00052, 0.00050, 0.00055, 0.00049, 0.00053, 0.00051, 0.00055,  # the warmup's replies
                0.0037, 0.0041, 0.0044, 0.0040, 0.026, 0.031, 0.029, 0.034, 0.061, 0.066, 0.063, 0.066]
"""A body's input gradients early in the replicated swarm test, as one trainer received them (per-sample RMS,
4 replies a step): about 0.0005 in the warmup's replies, 0.066 twelve replies (three steps) later."""


def default_tracker(**overrides) -> NormTracker:
    v = Run().validation.model_copy(update=overrides)
    return NormTracker(v.norm_multiple, v.norm_window, v.warmup, v.early_multiple)


@pytest.mark.parametrize("sequence", [HONEST_EARLY, HONEST_EARLY[:8] + [0.0663] * 12],
                         ids=["rising", "a-step"])
def test_input_gradients_growing_early_in_training_pass(sequence):
    """The replicated swarm test's false positive: honest values 132x the warmup's median refused (and both body
    workers banned). Every one passes the default bound; a x1e6 value on that scale does not; the same sequence
    fails once the bound is norm_multiple from the start (the test can fail)."""
    tracker = default_tracker()
    for rms in sequence:
        tracker.observe(tracker.check("input gradient", torch.full((1, 8, 4), rms)))
    assert reason(tracker.check, "input gradient", torch.full((1, 8, 4), sequence[-1] * 1e6)) == "magnitude"
    strict = default_tracker(early_multiple=Run().validation.norm_multiple)
    with pytest.raises(Invalid):
        for rms in sequence:
            strict.observe(strict.check("input gradient", torch.full((1, 8, 4), rms)))


@pytest.mark.parametrize("scale", [1e-7, 1e-4, 1.0])
def test_a_x1e6_value_is_refused_at_once_whatever_the_stages_scale(scale):
    """Once the warmup is over (early or late in the run, on a stage whose values are tiny or not) the first
    x1e6 value is refused: no floor under the median lets it through."""
    tracker = default_tracker()
    for i in range(tracker.warmup):
        tracker.observe(tracker.check("wire", torch.full((1, 8, 4), scale * (1 + 0.1 * i))))
    assert tracker.current_multiple() == Run().validation.early_multiple
    assert reason(tracker.check, "wire", torch.full((1, 8, 4), scale * 1e6)) == "magnitude"
    for _ in range(tracker.recent.maxlen):
        tracker.observe(tracker.check("wire", torch.full((1, 8, 4), scale)))
    assert tracker.current_multiple() == Run().validation.norm_multiple
    assert reason(tracker.check, "wire", torch.full((1, 8, 4), scale * 1e6)) == "magnitude"


def test_the_early_bound_tightens_once_the_window_has_been_full():
    tracker = NormTracker(multiple=100, window=16, warmup=4, early_multiple=1e4)
    for _ in range(15):
        tracker.observe(tracker.check("wire", torch.ones(1, 4)))
    tracker.check("wire", torch.full((1, 4), 500.0))  # 500 x the median: honest growth early on
    tracker.observe(tracker.check("wire", torch.ones(1, 4)))  # the 16th: the window is full
    assert tracker.bound() == pytest.approx(100.0)
    assert reason(tracker.check, "wire", torch.full((1, 4), 500.0)) == "magnitude"
    assert NormTracker(multiple=100, early_multiple=10).current_multiple() == 100  # never below norm_multiple


def test_a_magnitude_fault_never_bans_a_stages_last_serving_worker():
    book = FaultBook(fault_ban_s=600)
    assert book.record("only", "body-1", "magnitude", others_serving=False) == 0  # refused, not banned
    assert book.record("only", "body-1", "non_finite", others_serving=False) > 0  # proof bans always
    assert book.record("one", "body-1", "magnitude", others_serving=True) == 600
    assert book.counts["only"] == {"stage": "body-1", "magnitude": 1, "non_finite": 1}  # still counted


def test_an_all_zero_history_does_not_reject_everything():
    tracker = NormTracker(multiple=10, window=8, warmup=2)
    tracker.observe([0.0, 0.0])
    assert tracker.bound() > 0
    assert reason(tracker.check, "grad", torch.ones(1, 4)) == "magnitude"  # but a bound exists


def test_losses_legitimately_large_early_in_training_pass():
    vocab = 50_000
    first = math.log(vocab) * 1.5  # a fresh model, worse than a uniform guess
    check_losses(torch.tensor([first, first * 2]), 2, vocab, multiple=10)
    check_losses(torch.tensor([0.0]), 1, vocab, multiple=10)
    assert reason(check_losses, torch.tensor([NAN]), 1, vocab, 10) == "non_finite"
    assert reason(check_losses, torch.tensor([1.0, float("inf")]), 2, vocab, 10) == "non_finite"
    assert reason(check_losses, torch.tensor([float("-inf")]), 1, vocab, 10) == "non_finite"
    assert reason(check_losses, torch.tensor([1, 2], dtype=torch.int32), 2, vocab, 10) == "dtype"
    assert reason(check_losses, torch.tensor([loss_bound(vocab, 10) + 1]), 1, vocab, 10) == "loss"
    assert reason(check_losses, torch.tensor([-1.0]), 1, vocab, 10) == "loss"
    assert reason(check_losses, torch.tensor([1.0, 2.0]), 1, vocab, 10) == "shape"


def test_averaging_parts_and_updates():
    local = torch.randn(1000) * 0.02
    assert part_problem(local + torch.randn(1000) * 0.01, float(local.pow(2).mean().sqrt()), 10) is None
    assert "non-finite" in part_problem(torch.full_like(local, NAN), 0.02, 10)
    assert "RMS" in part_problem(local * 1e6, float(local.pow(2).mean().sqrt()), 10)
    assert part_problem(local * 1e6, None, 10) is None  # only finiteness without a reference
    assert part_problem(local, 0.0, 10) is None  # all-zero values of ours bound nothing (a fresh delta)
    assert update_mask(torch.ones(4), torch.zeros(4), 10).all()
    update = torch.randn(1000) * 0.001
    update[:10] = NAN
    update[10:20] = 1e4
    mask = update_mask(update, local, 10)
    assert not mask[:20].any() and mask[20:].all()


def test_fault_book_bans_longer_on_every_repeat():
    book = FaultBook(fault_ban_s=600, max_ban_s=2000)
    assert book.record("p", "body-1", "non_finite") == 600
    assert book.record("p", "body-1", "magnitude") == 1200
    assert book.record("p", "body-1", "magnitude") == 2000
    assert book.counts["p"] == {"stage": "body-1", "non_finite": 1, "magnitude": 2} and book.total("p") == 3


def _replies(run: Run):
    n, length, k = 2, run.model.seq_len, run.model.ssn.rank or run.model.d_model
    ids = torch.randint(0, 256, (n, length + 1), dtype=torch.int32)
    return ids, torch.randn(n, length, k)


def test_reply_checks_follow_what_each_stage_promises():
    run = Run()
    checks = ReplyChecks(run)
    ids, wire = _replies(run)
    for _ in range(run.validation.warmup):
        checks.check("head", "forward", {"ids": ids}, {"wire": wire}, {"step": 0})
        checks.check("tail", "forward_backward", {"ids": ids, "wire": wire},
                     {"loss": torch.tensor([5.5, 6.0]), "grad": wire * 1e-3}, {"step": 0})
    checks.check("head", "backward", {"ids": ids, "grad": wire}, {}, {"step": 1})  # the head returns no gradient
    assert reason(checks.check, "head", "forward", {"ids": ids}, {"wire": wire * NAN}, {}) == "non_finite"
    assert reason(checks.check, "head", "forward", {"ids": ids}, {"wire": wire * 1e6}, {}) == "magnitude"
    assert reason(checks.check, "head", "forward", {"ids": ids}, {"wire": wire[:, :-1]}, {}) == "shape"
    assert reason(checks.check, "head", "forward", {"ids": ids}, {"wire": wire.half()}, {}) == "dtype"
    assert reason(checks.check, "tail", "forward_backward", {"ids": ids, "wire": wire},
                  {"loss": torch.tensor([5.5, NAN]), "grad": wire}, {}) == "non_finite"
    assert reason(checks.check, "tail", "forward_backward", {"ids": ids, "wire": wire},
                  {"loss": torch.tensor([5.5, 5.0]), "grad": wire * 1e6}, {}) == "magnitude"
    assert reason(checks.check, "head", "forward", {"ids": ids}, {"wire": wire},
                  {"step": run.training.max_steps + 1}) == "shape"


def test_an_absurd_output_caused_by_an_input_accepted_unbounded_is_nobodys_fault():
    """A trainer's first head replies come from a replica already absurd (x1e6): accepted, no bound yet; the
    honest body's output is then absurd too — rejected, but not attributable (nobody is banned for it)."""
    run = Run()
    checks = ReplyChecks(run)
    ids, wire = _replies(run)
    for _ in range(run.validation.warmup):  # the body's bound exists; the head's does not
        checks.check("body-1", "forward", {"ids": ids, "wire": wire}, {"wire": wire}, {"step": 0})
    checks.check("head", "forward", {"ids": ids}, {"wire": wire * 1e6}, {"step": 0})  # accepted unbounded
    with pytest.raises(Invalid) as e:
        checks.check("body-1", "forward", {"ids": ids, "wire": wire * 1e6}, {"wire": wire * 1e6}, {"step": 0})
    assert e.value.reason == "magnitude" and not e.value.attributable
    for _ in range(run.validation.warmup):  # now the head has a bound, and the input is within it
        checks.check("head", "forward", {"ids": ids}, {"wire": wire}, {"step": 0})
    with pytest.raises(Invalid) as e:
        checks.check("body-1", "forward", {"ids": ids, "wire": wire}, {"wire": wire * 1e6}, {"step": 0})
    assert e.value.attributable  # the body made it absurd itself
    for _ in range(run.validation.warmup):  # bounds for the tail's and the body's input gradients
        checks.check("tail", "forward_backward", {"ids": ids, "wire": wire},
                     {"loss": torch.tensor([5.5, 6.0]), "grad": wire}, {"step": 0})
        checks.check("body-1", "backward", {"ids": ids, "wire": wire, "grad": wire}, {"grad": wire}, {"step": 0})
    with pytest.raises(Invalid) as e:  # an input gradient from the tail beyond the tail's bound: not the body's
        checks.check("body-1", "backward", {"ids": ids, "wire": wire, "grad": wire * 1e9}, {"grad": wire * 1e6}, {})
    assert not e.value.attributable


def test_refused_outputs_needs_notices_from_several_trainers_within_the_window():
    rules = SelfTermination(SelfTerminationConfig(refused_outputs=3, refused_window_s=100, refused_min_trainers=2))
    for t in range(5):  # one trainer alone, however many notices, cannot make a worker leave
        assert rules.observe({"event": "refused", "trainer": "A", "time": float(t)}) is None
    fired = rules.observe({"event": "refused", "trainer": "B", "time": 6.0, "reason": "forward: NaN"})
    assert fired.rule == "refused_outputs" and fired.exit_code == EXIT_CODES["refused_outputs"] == 87
    late = SelfTermination(SelfTerminationConfig(refused_outputs=2, refused_window_s=10, refused_min_trainers=2))
    late.observe({"event": "refused", "trainer": "A", "time": 0.0})
    assert late.observe({"event": "refused", "trainer": "B", "time": 50.0}) is None  # the first one expired


def test_fault_drills_corrupt_what_they_name_after_their_onset():
    results = [{"wire": torch.ones(1, 4)}]
    corrupt_results("nan-outputs", "forward", results, [], computed=ONSET - 1)
    assert results[0]["wire"].eq(1).all()  # a device that goes bad mid-run: fine at first
    corrupt_results("nan-outputs", "forward", results, [])
    assert results[0]["wire"].isnan().all()
    results = [{"wire": torch.ones(1, 4)}]
    corrupt_results("huge-outputs", "forward", results, [])
    assert results[0]["wire"].eq(1e6).all()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    results = [{"grad": torch.ones(1, 4), "loss": torch.ones(1)}]
    corrupt_results("nan-grads", "forward_backward", results, [p])
    assert results[0]["grad"].isnan().all() and results[0]["loss"].isnan().all() and p.grad.isnan().all()
    values = torch.ones(5)
    assert corrupt_part("nan-parts", values).isnan().all() and corrupt_part("huge-parts", values).eq(1e6).all()
    assert corrupt_part(None, values) is values and values.eq(1).all()


def test_per_sample_rms_one_sample_or_many_in_fp32():
    one = torch.full((1, 8, 4), 3.0)
    assert rms_per_sample(one) == pytest.approx([3.0])
    many = torch.stack([torch.full((8, 4), 1.0), torch.full((8, 4), -2.0)]).to(torch.bfloat16)
    assert rms_per_sample(many) == pytest.approx([1.0, 2.0])
    assert rms_per_sample(torch.zeros(0, 8, 4)) == []
    assert math.isnan(rms_per_sample(torch.full((1, 2), NAN))[0])  # NaN stays visible to the tracker
