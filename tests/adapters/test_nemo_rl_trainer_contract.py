"""NeMo-RL's trainer contract: ``grpo.setup`` builds ``ClippedPGLossFn(cfg, use_fused_linear_logprobs=...)`` and the
workers read its attributes; ``prepare_loss_input`` (modelled in nemo_rl_host.py) hands the loss precomputed
log-probs in the Megatron fused-linear-logprobs mode and unfiltered log-probs under top-k / top-p training."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

from adapters.nemo_rl_host import HostLossConfig, V, clip_loss, filled, host_batch, k3, prepare_loss_input, run
from nemo_is_plugin.adapters.nemo_rl import NEMO_RL_CONFIG_ATTRIBUTES, ClippedPGLossFn


def test_constructor_and_attributes_as_nemo_rl():
    cfg = HostLossConfig(
        reference_policy_kl_penalty=0.02,
        use_kl_in_reward=True,
        ratio_clip_c=3.0,
        is_correction_level="token",
        use_importance_sampling_correction=True,
    )  # a plugin key as extra
    fn = ClippedPGLossFn(cfg, use_fused_linear_logprobs=True)
    assert fn.use_fused_linear_logprobs is True and fn.reference_policy_kl_penalty == 0
    assert all(getattr(fn, name) == getattr(cfg, name) for name in NEMO_RL_CONFIG_ATTRIBUTES)
    assert fn.ratio_clip_c == 3.0 and fn.config.is_correction_level == "token"
    assert ClippedPGLossFn(cfg).use_fused_linear_logprobs is False
    assert pickle.loads(pickle.dumps(fn)).use_fused_linear_logprobs is True  # shipped to the Ray workers
    with pytest.raises(ValueError, match="use_fused_linear_logprobs=True: .* use input_type='logprob'"):
        ClippedPGLossFn(cfg, use_fused_linear_logprobs=True, input_type="logit")


def test_fused_linear_logprobs_mode_gets_the_precomputed_logprobs():
    """Megatron's fused forward returns next-token log-probs (possibly longer than S-1); prepare_loss_input casts and
    cuts them; the loss equals the one on log-probs from logits."""
    g = torch.Generator().manual_seed(3)
    data = filled(gen=torch.tensor([[-0.8, -1.9, -1.0]]), ref=torch.tensor([[-1.5, -1.2, -0.9]]))
    cfg = HostLossConfig(use_importance_sampling_correction=True)
    logits = torch.randn(1, 4, V, generator=g)
    want, want_m = run(ClippedPGLossFn(cfg), data, logits=logits)
    lp = prepare_loss_input(logits, data, ClippedPGLossFn(cfg))[0]["next_token_logprobs"]
    fused_out = torch.cat([lp, torch.full((1, 2), -3.0)], dim=1).to(torch.bfloat16).float()  # model pads to S+1
    fused = ClippedPGLossFn(cfg, use_fused_linear_logprobs=True)
    got, got_m = run(fused, data, logits=fused_out.clone().requires_grad_(True))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)  # bf16 rounding of the model output
    assert got_m.keys() == want_m.keys()


def test_top_k_training_feeds_the_kl_from_unfiltered_logprobs():
    """With filtering, NeMo-RL's KL (and its weight) read data['curr_logprobs_unfiltered']; the actor loss reads the
    filtered log-probs. Checked against the two terms computed by hand."""
    g = torch.Generator().manual_seed(11)
    data = host_batch(batch=2, seq=5)
    data.update(
        advantages=torch.randn(2, 5, generator=g),
        prev_logprobs=-torch.rand(2, 5, generator=g),
        generation_logprobs=-torch.rand(2, 5, generator=g),
        reference_policy_logprobs=-torch.rand(2, 5, generator=g) - 1.0,
    )
    logits = torch.randn(2, 5, V, generator=g, requires_grad=True)
    fn = ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.1))
    loss_input, prepared = prepare_loss_input(logits, data, fn, top_k=3)
    assert "curr_logprobs_unfiltered" in prepared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _ = fn(data=prepared, global_valid_seqs=torch.tensor(2), global_valid_toks=torch.tensor(8), **loss_input)
    c, unf = loss_input["next_token_logprobs"], prepared["curr_logprobs_unfiltered"]
    sl = lambda k: data[k][:, 1:]  # noqa: E731
    actor = clip_loss(sl("advantages"), c, sl("prev_logprobs")).sum() / 8
    kl = 0.1 * (torch.exp(unf - unf.detach()) * k3(unf, sl("reference_policy_logprobs"))).clamp(max=10).sum() / 8
    torch.testing.assert_close(loss, actor + kl)
    filtered_kl = 0.1 * k3(c, sl("reference_policy_logprobs")).clamp(max=10).sum() / 8
    assert not math.isclose(loss.item(), (actor + filtered_kl).item(), rel_tol=1e-4)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (want,) = torch.autograd.grad(actor + kl, logits)
    torch.testing.assert_close(grad, want)
