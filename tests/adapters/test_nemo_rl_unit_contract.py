"""A model of NeMo-RL's own ClippedPGLossFn unit tests (tests/unit/algorithms/test_loss_functions.py at 7ea279ab) run
against the adapter: NeMo-RL's pydantic config in, ``ClippedPGLossFn(cfg)`` built from the adapter module, inputs
prepared the way ``prepare_loss_input`` does, and each assertion of the same kind NeMo-RL makes (default
``assert_close`` tolerances, ``==`` on metrics, ``pytest.raises(AssertionError, match=...)``). The loss values
here; the metric normalisations it advertises: test_nemo_rl_unit_contract_metrics.py.

The data and hand computations are this file's own; each test names the NeMo-RL test it models.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from adapters.nemo_rl_host import ADV, CURR, PREV, HostLossConfig, V, clip_loss, filled, host_batch, k3, run
from nemo_is_plugin.adapters.nemo_rl import ClippedPGLossFn


# ----------------------------------------------------------------------------------- the loss value, mode by mode
def test_ppo_clipping():  # test_clipped_pg_loss_ppo_clipping
    loss, _ = run(ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.0)), filled(), CURR)
    torch.testing.assert_close(loss, clip_loss(ADV, CURR, PREV).mean())


def test_reinforce_mode():  # test_clipped_pg_loss_reinforce_mode
    cfg = HostLossConfig(
        reference_policy_kl_penalty=0.0, disable_ppo_ratio=True, ratio_clip_min=0.0, ratio_clip_max=0.0
    )
    loss, _ = run(ClippedPGLossFn(cfg), filled(), CURR)
    torch.testing.assert_close(loss, (-ADV * CURR).mean())


def test_force_on_policy_ratio_metrics_are_exactly_one():  # test_clipped_pg_loss_force_on_policy_ratio
    fn = ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True))
    loss, metrics = run(fn, filled(), CURR)
    torch.testing.assert_close(loss, -ADV.mean(), rtol=1e-3, atol=1e-3)
    for key in (
        "probs_ratio",
        "probs_ratio_clamped",
        "probs_ratio_min",
        "probs_ratio_max",
        "probs_ratio_clamped_min",
        "probs_ratio_clamped_max",
    ):
        assert metrics[key] == 1.0, key


def test_force_on_policy_ratio_ignores_prev_logprobs():  # ..._force_on_policy_ratio_ignores_prev_logprobs
    fn = ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True))
    loss_1, m_1 = run(fn, filled(prev=CURR), CURR)
    loss_2, m_2 = run(fn, filled(prev=torch.full((1, 3), -9.0)), CURR)
    torch.testing.assert_close(loss_1, loss_2)
    assert m_1["probs_ratio"] == m_2["probs_ratio"] == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"disable_ppo_ratio": True},
        {"force_on_policy_ratio": True},
        {"ratio_clip_c": 3.0},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
    ],
)
def test_cispo_incompatibility_asserts(bad):  # test_clipped_pg_loss_cispo_incompatibility_asserts
    cfg = HostLossConfig(reference_policy_kl_penalty=0.0, use_cispo=True, **bad)
    with pytest.raises(AssertionError):
        ClippedPGLossFn(cfg)


@pytest.mark.parametrize("with_is", [False, True])
def test_cispo(with_is):  # test_clipped_pg_loss_cispo, ..._cispo_with_importance_sampling_correction
    gen = torch.tensor([[-0.9, -1.6, -1.0]])
    fn = ClippedPGLossFn(
        HostLossConfig(reference_policy_kl_penalty=0.0, use_cispo=True, use_importance_sampling_correction=with_is)
    )
    loss, _ = run(fn, filled(gen=gen), CURR)
    w = torch.exp(PREV - gen) if with_is else torch.ones(1, 3)
    want = (w * -ADV * torch.exp(CURR - PREV).clamp(0.8, 1.2) * CURR).mean()
    torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)


def test_kl_penalty():  # test_clipped_pg_loss_kl_penalty
    curr, ref = torch.tensor([[0.0, -0.5, -2.5]]), torch.tensor([[-0.7, -0.7, -0.7]])
    data = filled(adv=torch.zeros(1, 3), prev=torch.zeros(1, 3), ref=ref)
    loss, _ = run(ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.1)), data, curr)
    torch.testing.assert_close(loss, 0.1 * k3(curr, ref).mean())


@pytest.mark.parametrize("on_policy", [False, True])
def test_kl_gradient_includes_sampling_term(on_policy):  # test_clipped_pg_loss_kl_gradient_includes_sampling_term
    curr, gen, ref = torch.tensor([[-0.4, -1.3]]), torch.tensor([[-0.7, -1.1]]), torch.tensor([[-1.0, -0.6]])
    pad = lambda t: torch.cat([torch.zeros(1, 1), t], -1)  # noqa: E731

    def grad(beta):
        x = curr.clone().requires_grad_(True)
        data = {
            "input_ids": torch.zeros(1, 3, dtype=torch.int64),
            "token_mask": torch.tensor([[0, 1, 1]]),
            "sample_mask": torch.tensor([1]),
            "advantages": pad(torch.tensor([[0.3, -0.6]])),
            "prev_logprobs": pad(torch.tensor([[-0.5, -1.2]])),
            "generation_logprobs": pad(gen),
            "reference_policy_logprobs": pad(ref),
        }
        fn = ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=beta, use_on_policy_kl_approximation=on_policy))
        loss, _ = fn(
            next_token_logprobs=x, data=data, global_valid_seqs=torch.tensor(1), global_valid_toks=torch.tensor(2)
        )
        loss.backward()
        return x.grad

    logr = ref - curr
    weight = torch.exp(curr - gen) if on_policy else torch.ones_like(curr)
    want = 0.25 * weight * (k3(curr, ref) + 1 - torch.exp(logr)) / 2  # the score-function term plus the pathwise one
    torch.testing.assert_close(grad(0.25) - grad(0.0), want)


def test_masking():  # test_clipped_pg_loss_masking
    g = torch.Generator().manual_seed(5)
    data = host_batch(batch=2)
    data.update(
        prev_logprobs=torch.randn(2, 4, generator=g) * 0.1,  # slightly positive values included
        reference_policy_logprobs=torch.randn(2, 4, generator=g) * 0.1,
        advantages=torch.randn(2, 4, generator=g) + 1.0,
    )
    logits = torch.randn(2, 4, V, generator=g)
    fn = ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, _ = run(fn, data, logits=logits)
        token_masked = dict(data, token_mask=data["token_mask"].clone())
        token_masked["token_mask"][0, 1] = 0
        assert not torch.isclose(full, run(fn, token_masked, logits=logits)[0], atol=1e-4)
        one, _ = run(fn, dict(data, sample_mask=torch.tensor([1, 0])), logits=logits)
        alone, _ = run(fn, {k: v[:1] for k, v in data.items()}, logits=logits[:1])
    torch.testing.assert_close(one, alone)


def test_zero_mask():  # test_clipped_pg_loss_zero_mask
    data = host_batch()
    data["token_mask"] = torch.zeros_like(data["token_mask"])
    loss, _ = run(
        ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.1)),
        data,
        logits=torch.randn(1, 4, V, generator=torch.Generator().manual_seed(1)),
    )
    torch.testing.assert_close(loss, torch.tensor(0.0))


def test_on_policy_kl_with_importance_sampling():  # test_clipped_pg_loss_on_policy_kl_importance_sampling
    gen, ref = torch.tensor([[-0.8, -1.9, -1.0]]), torch.tensor([[-1.5, -1.2, -0.9]])
    fn = ClippedPGLossFn(
        HostLossConfig(
            reference_policy_kl_penalty=0.1,
            use_on_policy_kl_approximation=True,
            use_importance_sampling_correction=True,
        )
    )
    loss, _ = run(fn, filled(gen=gen, ref=ref), CURR)
    actor = (torch.exp(PREV - gen) * clip_loss(ADV, CURR, PREV)).mean()
    kl = 0.1 * (torch.exp(CURR - gen) * k3(CURR, ref)).mean()
    torch.testing.assert_close(loss, actor + kl, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("gspo", [True, False])
def test_truncated_importance_sampling(gspo):  # test_clipped_pg_loss_on_policy_truncated_importance_sampling
    gen = torch.tensor([[-0.8, -1.9, -1.0]])
    cfg = HostLossConfig(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=0.9,
        truncated_importance_sampling_type="tis",
    )
    if gspo:  # set after construction, as NeMo-RL's test does
        cfg.sequence_level_importance_ratios = True
        cfg.token_level_loss = False
    loss, _ = run(ClippedPGLossFn(cfg), filled(gen=gen), CURR)
    if gspo:
        r = torch.exp((CURR - PREV).mean(-1, keepdim=True))
        per_token = torch.maximum(-ADV * r, -ADV * r.clamp(0.8, 1.2))
        w = torch.exp((PREV - gen).sum(-1, keepdim=True)).clamp(max=0.9)
    else:
        per_token, w = clip_loss(ADV, CURR, PREV), torch.exp(PREV - gen).clamp(max=0.9)
    torch.testing.assert_close(loss, (w * per_token).mean(), atol=1e-4, rtol=1e-3)


def test_icepop():  # test_clipped_pg_loss_icepop_importance_sampling
    gen = torch.tensor([[-0.7, -4.0, -1.0]])  # the middle weight e^2.8 > 5 is dropped
    fn = ClippedPGLossFn(
        HostLossConfig(
            reference_policy_kl_penalty=0.0,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=5.0,
            truncated_importance_sampling_ratio_min=0.5,
        )
    )
    loss, _ = run(fn, filled(gen=gen), PREV)
    w = torch.exp(PREV - gen)
    w = torch.where((w >= 0.5) & (w <= 5.0), w, torch.zeros_like(w))
    torch.testing.assert_close(loss, (w * -ADV).mean(), atol=1e-4, rtol=1e-3)


def test_reports_is_oob_ratio_tis():  # test_clipped_pg_loss_reports_is_oob_ratio_tis
    fn = ClippedPGLossFn(
        HostLossConfig(
            reference_policy_kl_penalty=0.0,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
        )
    )
    data = filled(adv=torch.ones(1, 3), prev=torch.log(torch.tensor([[2.5, 1.0, 0.4]])))  # log 2.5 > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, metrics = fn(
            next_token_logprobs=torch.zeros(1, 3),
            data=data,
            global_valid_seqs=torch.sum(data["sample_mask"]),
            global_valid_toks=torch.sum(data["sample_mask"] * data["token_mask"]),
        )
    assert metrics["is_oob_ratio"] == pytest.approx(1.0 / 3.0)


@pytest.mark.parametrize("tis_type", ["tis", "icepop", "seq-mask-tis"])
def test_rejects_tis_min_above_max(tis_type):  # test_clipped_pg_loss_rejects_tis_min_above_max
    cfg = HostLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type=tis_type,
        truncated_importance_sampling_ratio=1.0,
        truncated_importance_sampling_ratio_min=2.0,
    )
    with pytest.raises(
        AssertionError, match="truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio"
    ):
        ClippedPGLossFn(cfg)


@pytest.mark.parametrize("tis_min, weights, oob", [(None, [0.2, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)])
def test_tis_min_bound_defaults_to_zero(tis_min, weights, oob):  # ..._tis_min_bound_defaults_to_zero
    fn = ClippedPGLossFn(
        HostLossConfig(
            reference_policy_kl_penalty=0.0,
            use_importance_sampling_correction=True,
            force_on_policy_ratio=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
            truncated_importance_sampling_ratio_min=tis_min,
        )
    )
    data = filled(adv=torch.ones(1, 3), gen=torch.zeros(1, 3))
    x = torch.log(torch.tensor([[0.2, 1.0, 2.5]]))  # log 2.5 > 0: NeMo-RL's tests pass such log-probs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics = fn(
            next_token_logprobs=x,
            data=data,
            global_valid_seqs=torch.sum(data["sample_mask"]),
            global_valid_toks=torch.sum(data["sample_mask"] * data["token_mask"]),
        )
    torch.testing.assert_close(loss, -torch.tensor(weights).mean())
    assert metrics["is_oob_ratio"] == pytest.approx(oob)


def test_seq_mask_tis_and_neg_inf_generation():  # test_clipped_pg_loss_seq_mask_tis
    fn = ClippedPGLossFn(
        HostLossConfig(
            reference_policy_kl_penalty=0.0,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio=1.002,
            truncated_importance_sampling_ratio_min=0.999,
        )
    )
    gen = PREV - 0.0008
    data = filled(gen=gen)
    loss, _ = run(fn, data, PREV)
    torch.testing.assert_close(loss, (torch.exp(PREV - gen) * -ADV).mean(), atol=1e-4, rtol=1e-3)
    data["generation_logprobs"][0, 2] = float("-inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _ = run(fn, data, PREV)
    assert not torch.isnan(loss) and not torch.isinf(loss)


def test_dual_clip():  # test_clipped_pg_loss_dual_clip
    adv, prev = torch.tensor([[1.5, -0.5, -3.0]]), torch.tensor([[-1.0, -2.0, -4.0]])
    curr = prev + torch.log(torch.tensor([[0.7, 1.0, 8.0]]))
    fn = ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.0, ratio_clip_c=2.5))
    loss, _ = run(fn, filled(adv=adv, prev=prev), curr)
    base = clip_loss(adv, curr, prev)
    want = torch.where(adv < 0, torch.minimum(base, -adv * 2.5), base)
    torch.testing.assert_close(loss, want.mean())


def test_entropy():  # test_clipped_pg_loss_entropy
    curr, gen = torch.tensor([[-0.3, -1.4, -2.2]]), torch.tensor([[-0.5, -1.2, -2.0]])
    _, metrics = run(ClippedPGLossFn(HostLossConfig(reference_policy_kl_penalty=0.0)), filled(gen=gen), curr)
    torch.testing.assert_close(
        torch.tensor(metrics["approx_entropy"]), -(torch.exp(curr - gen) * curr).mean(), rtol=1e-3, atol=1e-5
    )


@pytest.mark.parametrize("batch", [1, 2])
def test_gspo(batch):  # test_clipped_pg_loss_gspo, test_clipped_pg_loss_gspo_batch_size_2
    prev = torch.cat([PREV, PREV - 0.8])[:batch]
    curr = torch.cat([CURR, CURR])[:batch]
    adv = ADV.expand(batch, 3)
    fn = ClippedPGLossFn(
        HostLossConfig(reference_policy_kl_penalty=0.0, sequence_level_importance_ratios=True, token_level_loss=False)
    )
    loss, _ = run(fn, filled(host_batch(batch=batch), adv=adv, prev=prev), curr)
    r = torch.exp((curr - prev).mean(-1, keepdim=True))
    torch.testing.assert_close(loss, torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)).mean())


def test_gspo_importance_sampling_correction():  # test_clipped_pg_loss_gspo_importance_sampling_correction
    gen = torch.tensor([[-0.8, -1.9, -1.0]])
    fn = ClippedPGLossFn(
        HostLossConfig(
            reference_policy_kl_penalty=0.0,
            use_importance_sampling_correction=True,
            sequence_level_importance_ratios=True,
            token_level_loss=False,
        )
    )
    loss, _ = run(fn, filled(gen=gen), CURR)
    r = torch.exp((CURR - PREV).mean(-1, keepdim=True))
    w = torch.exp((PREV - gen).sum(-1, keepdim=True))
    torch.testing.assert_close(
        loss, (w * torch.maximum(-ADV * r, -ADV * r.clamp(0.8, 1.2))).mean(), atol=1e-4, rtol=1e-3
    )
