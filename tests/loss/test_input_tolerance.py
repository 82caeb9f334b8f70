"""The default input policy (``strict_input_checks: false``): what NeMo-RL computes finitely is computed the same way
and reported (metrics + one warning per kind), what would make NeMo-RL's loss NaN is refused; the strict mode refuses
all of it. See nemo_is_plugin/loss/input_validation.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.common import once
from nemo_is_plugin.loss.input_validation import MissingInputError

B, S = 3, 8
BASE = dict(reference_policy_kl_penalty=0.05, use_importance_sampling_correction=True)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(once, "_WARNED", set())


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = lambda: -torch.rand(B, S, generator=g) * 2 - 0.01  # noqa: E731
    tm = torch.ones(B, S)
    tm[:, 0] = 0
    tm[2, 6:] = 0
    data = {
        "token_mask": tm,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": lp(),
        "generation_logprobs": lp(),
        "reference_policy_logprobs": lp(),
        "rewards": torch.tensor([1.0, 0.0, 2.0]),
    }
    return -torch.rand(B, S - 1, generator=g) * 2 - 0.01, data


def call(cfg, x, data, grad=False):
    x = x.clone().requires_grad_(grad)
    n_tok = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    loss, metrics = build_loss_fn(cfg)(
        next_token_logprobs=x, data=data, global_valid_seqs=data["sample_mask"].sum(), global_valid_toks=n_tok
    )
    if grad:
        loss.backward()
        return loss.detach(), metrics, x.grad
    return loss, metrics


@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), float("inf")])
def test_non_finite_generation_logprob_gets_is_weight_zero(bad):
    """NeMo-RL nan_to_num's the IS weight: the token counts as if its weight were exp(-200) = 0 in float32."""
    x, data = batch()
    zero_weight = {k: v.clone() for k, v in data.items()}
    zero_weight["generation_logprobs"][1, 3] = zero_weight["prev_logprobs"][1, 3] + 200.0
    data["generation_logprobs"][1, 3] = bad
    with pytest.warns(UserWarning, match="generation_logprobs'\\] holds NaN / inf on valid tokens"):
        loss, metrics, grad = call(BASE, x, data, grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # g = p + 200 is a positive log-prob
        want, want_metrics, want_grad = call(BASE, x, zero_weight, grad=True)
    assert torch.isfinite(loss) and loss.item() == want.item() and torch.equal(grad, want_grad)
    assert metrics["input_nonfinite_generation_fraction"] == pytest.approx(1 / 19)
    assert metrics["sampling_importance_ratio"] == pytest.approx(want_metrics["sampling_importance_ratio"], rel=1e-6)
    assert math.isfinite(metrics["mismatch_kl_k3"]) and math.isfinite(metrics["is_weight_sq_mean"])


def test_non_finite_generation_logprob_in_padding_is_neither_counted_nor_harmful():
    x, data = batch()
    want, _ = call(BASE, x, data)
    data["generation_logprobs"][2, 7] = float("-inf")  # token_mask[2, 7] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report
        loss, metrics = call(BASE, x, data)
    assert loss.item() == want.item() and metrics["input_nonfinite_generation_fraction"] == 0.0
    assert all(math.isfinite(v) for k, v in metrics.items() if not k.endswith(("_min", "_max")))


def test_positive_logprobs_are_computed_as_given_and_counted():
    x, data = batch()
    x[0, 2] = math.log(3.0)  # NeMo-RL's own tests use log 3
    data["prev_logprobs"][1, 4] = 0.25
    data["reference_policy_logprobs"][2, 7] = 0.5  # padding: not counted
    with pytest.warns(UserWarning, match="log-probs above 0"):
        loss, metrics = call(BASE, x, data)
    assert torch.isfinite(loss) and metrics["input_positive_logprob_fraction"] == pytest.approx(2 / 19)
    # the positive current log-prob enters as given: its ratio is exp(log 3 - p), 3 times that of c = 0
    x0 = x.clone()
    x0[0, 2] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at_zero = call(BASE, x0, data)[1]
    step = 2.0 * math.exp(-data["prev_logprobs"][0, 3].item()) / 19
    assert metrics["probs_ratio"] - at_zero["probs_ratio"] == pytest.approx(step, rel=1e-5)
    x[0, 2] = 5e-5  # within float32 log_softmax rounding: not counted
    data["prev_logprobs"][1, 4] = -0.1
    assert call(BASE, x, data)[1]["input_positive_logprob_fraction"] == 0.0


def test_each_kind_warns_once_per_process():
    x, data = batch()
    x[0, 2] = 0.5
    with pytest.warns(UserWarning) as first:
        call(BASE, x, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(BASE, x, data)
    assert len([w for w in first if "log-probs above 0" in str(w.message)]) == 1


def test_nll_weight_without_rewards_skips_the_term_as_nemo_rl():
    x, data = batch()
    cfg = dict(BASE, positive_example_nll_weight=0.5)
    del data["rewards"]
    with pytest.warns(UserWarning, match="no 'rewards': the positive-example NLL term is skipped"):
        loss, metrics = call(cfg, x, data)
    assert loss.item() == call(BASE, x, data)[0].item() and metrics["positive_nll_loss"] == 0.0
    with pytest.raises(MissingInputError, match="'rewards' \\(needed by positive_example_nll_weight > 0\\)"):
        call(dict(cfg, strict_input_checks=True), x, data)


def test_negative_nll_weight_is_refused_rather_than_silently_dropped():
    """NeMo-RL drops the NLL term for a weight <= 0 without a word; the plugin refuses a negative weight (a typo) with
    the key's valid range and the fix (docs/nemo_rl.md, "Where the plugin deliberately differs")."""
    with pytest.raises(
        ValueError, match=r"positive_example_nll_weight=-0.5 is outside its valid range \[0, inf\).*use 0"
    ):
        build_loss_fn(dict(BASE, positive_example_nll_weight=-0.5))


@pytest.mark.parametrize("key", ["prev_logprobs", "reference_policy_logprobs", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_inputs_that_make_nemo_rls_loss_non_finite_are_refused_by_default(key, bad):
    x, data = batch()
    data[key][0, 5] = bad
    with pytest.raises(ValueError, match=rf"data\['{key}'\] contains NaN or inf"):
        call(BASE, x, data)


@pytest.mark.parametrize("mutate", ["gen_inf", "positive", "unfiltered_positive"])
def test_strict_mode_refuses_what_the_default_reports(mutate):
    x, data = batch()
    if mutate == "gen_inf":
        data["generation_logprobs"][0, 1] = float("-inf")
        pattern = r"data\['generation_logprobs'\] contains NaN or inf"
    elif mutate == "positive":
        x[1, 1] = 0.3
        pattern = "next_token_logprobs holds positive log-probs"
    else:
        data["curr_logprobs_unfiltered"] = x.clone()
        data["curr_logprobs_unfiltered"][1, 1] = 0.3
        pattern = r"data\['curr_logprobs_unfiltered'\] holds positive log-probs"
    with pytest.raises(ValueError, match=pattern):
        call(dict(BASE, strict_input_checks=True), x, data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.isfinite(call(BASE, x, data)[0])


def test_unfiltered_logprobs_are_validated_like_the_current_ones():
    x, data = batch()
    data["curr_logprobs_unfiltered"] = torch.zeros(B, S)
    with pytest.raises(ValueError, match=r"curr_logprobs_unfiltered'\] has shape \[3, 8\], expected \[B, S-1\]"):
        call(BASE, x, data)
    data["curr_logprobs_unfiltered"] = x.clone()
    data["curr_logprobs_unfiltered"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"curr_logprobs_unfiltered'\] contains NaN or inf"):
        call(BASE, x, data)
    call(dict(BASE, reference_policy_kl_penalty=0.0), x, data)  # not read without the KL penalty (NeMo-RL)


def test_non_finite_rewards_are_only_compared_with_zero_as_nemo_rl():
    """NeMo-RL reads rewards as ``reward > 0``: NaN and -inf are not positive, +inf is."""
    x, data = batch()
    cfg = dict(BASE, positive_example_nll_weight=0.5)
    want, _ = call(cfg, x, dict(data, rewards=torch.tensor([-1.0, 0.0, 3.0])))
    with pytest.warns(UserWarning, match=r"data\['rewards'\] holds NaN or inf; only 'reward > 0' is read"):
        got, _ = call(cfg, x, dict(data, rewards=torch.tensor([float("nan"), float("-inf"), float("inf")])))
    assert got.item() == want.item()
    with pytest.raises(ValueError, match=r"data\['rewards'\] contains NaN or inf"):
        call(dict(cfg, strict_input_checks=True), x, dict(data, rewards=torch.tensor([float("nan"), 0.0, 1.0])))
