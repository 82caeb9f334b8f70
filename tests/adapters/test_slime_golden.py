"""Backward compatibility with slime: with no plugin keys (``nemo_is: {}``) the adapter's full loss is slime's
``policy_loss_function`` (loss as rescaled by ``loss_function``, metrics, logit gradients) and its TIS function is
slime's ``vanilla_tis_function`` / ``icepop_function``, on golden cases computed by slime 624b824a's own code
(tests/data/golden/slime/README.md)."""

from __future__ import annotations

import pytest
import torch
from helpers.golden_utils import GOLDEN

from adapters.slime_host import loss_function, namespace, tis_call
from nemo_is_plugin.adapters.slime import SlimeISCorrection, SlimePolicyLoss

SUITE = GOLDEN / "slime"
POLICY = [torch.load(p, weights_only=True) for p in sorted((SUITE / "policy").glob("case_*.pt"))]
TIS = [torch.load(p, weights_only=True) for p in sorted((SUITE / "tis").glob("case_*.pt"))]
PLUGIN_ONLY = "nemo_is/"


def run_policy(case: dict, entry=None, **overrides):
    args = namespace(case["args"], **overrides)
    x = case["logits"].clone().requires_grad_(True)
    scaled, _, metrics = loss_function(
        entry or SlimePolicyLoss(),
        args,
        case["batch"],
        x,
        num_microbatches=case["num_microbatches"],
        step_global_batch_size=case["step_global_batch_size"],
    )
    scaled.backward()
    return scaled.detach(), metrics, x.grad


def test_the_suite_covers_slimes_options():
    assert len(POLICY) >= 15 and len(TIS) >= 3
    ids = {c["id"] for c in POLICY}
    assert {"gspo", "cispo", "icepop", "kl_low_var_unbiased", "per_token_loss", "bypass_rollout_logprobs_tis"} <= ids


@pytest.mark.parametrize("case", POLICY, ids=[c["id"] for c in POLICY])
def test_full_loss_equals_slimes_policy_loss(case):
    loss, metrics, grad = run_policy(case)
    torch.testing.assert_close(loss, case["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, case["logits_grad"], rtol=1e-4, atol=1e-6)
    assert grad.abs().max() > 0
    # every slime metric, under slime's name and value; the plugin's own carry its prefix
    assert set(case["metrics"]) <= set(metrics)
    assert all(k.startswith(PLUGIN_ONLY) for k in set(metrics) - set(case["metrics"]))
    for name, want in case["metrics"].items():
        assert float(metrics[name]) == pytest.approx(want, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("case", TIS, ids=[c["id"] for c in TIS])
def test_tis_function_equals_slimes(case):
    keys = {"truncated_importance_sampling_type": "icepop"} if case["function"] == "icepop_function" else {}
    args = namespace(case["args"], nemo_is=keys)
    pg_loss, masks, metrics = tis_call(SlimeISCorrection(), args, case["inputs"])
    torch.testing.assert_close(pg_loss, case["pg_loss"], rtol=1.2e-7, atol=0)
    assert len(masks) == len(case["masks"]) and all(torch.equal(a, b) for a, b in zip(masks, case["masks"]))
    for name, want in case["metrics"].items():
        torch.testing.assert_close(metrics[name], want, rtol=1.2e-7, atol=0, msg=name)
    # the truncation did something in every case: the golden data exercise the bounds
    assert case["metrics"]["tis_clipfrac"].sum() > 0


def test_slimes_icepop_path_maps_to_the_plugins_icepop():
    """``--custom-tis-function-path slime...icepop_function`` with the full loss: the plugin's icepop, same result."""
    case = next(c for c in POLICY if c["id"] == "icepop")
    assert case["args"]["custom_tis_function_path"].endswith("icepop_function")
    vanilla = run_policy(case, custom_tis_function_path=None)
    assert not torch.allclose(vanilla[0], case["loss"])  # icepop and vanilla TIS differ on this batch


def test_plugin_keys_change_the_loss_from_slimes():
    """A plugin key is not ignored: sequence-level IS gives a different loss than slime's token TIS."""
    case = next(c for c in POLICY if c["id"] == "vanilla_tis")
    loss, _, _ = run_policy(case, nemo_is={"is_correction_level": "sequence_mean"})
    assert not torch.allclose(loss, case["loss"], rtol=1e-3)
