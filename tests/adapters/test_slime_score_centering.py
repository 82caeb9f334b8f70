"""Score centering through slime's full loss (``policy_loss``) with upstream slime's head in the batch (THUDM/slime
2e5cd7cd: per-sample ``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` ``[R_i, k]``), float64, on slime's call
model (``slime_host``: packed samples of different lengths, CP-local per-sample lists).

The reference is the plugin's ``ClippedPGLoss`` on the same tokens, padded ``[B, S]`` with its own one-log-softmax
head (``logits=``): with slime's per-token reducer (a token sum) divided by the token count, the loss, the gradient
with respect to the logits and the score-centering metrics equal ``token-mean``'s. The head has an empty (-inf) slot
and sampled tokens outside it, the sampler a distribution different from the trainer's.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from adapters.slime_host import loss_function, sum_of_sample_mean
from nemo_is_plugin.adapters.sampler_checks import ScoreCenteringSamplerError
from nemo_is_plugin.adapters.shared import given_keys
from nemo_is_plugin.adapters.slime import SlimePolicyLoss
from nemo_is_plugin.adapters.slime.config import policy_config
from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.masked import EPS

V, K, TEMPERATURE = 11, 3, 0.8
TOTALS, RESPONSES = [7, 5, 9], [4, 3, 5]
SETTINGS = {  # slime flags, plugin keys
    "plain": ({}, {}),
    "tis": ({"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5}, {}),
    "icepop_sequence": (
        {"use_tis": True, "custom_tis_function_path": "slime.backends.megatron_utils.loss.icepop_function"},
        {"truncated_importance_sampling_ratio": 1.6, "truncated_importance_sampling_ratio_min": 0.6},
    ),
}
SC_METRICS = ("sampler_tail", "trainer_tail", "tail_ratio", "drift", "grad_abs", "pg_grad_abs", "sampled_in_head")


def head_case(seed: int = 0) -> dict:
    """A packed micro-batch: logits [1, T, V], the samples' tokens, and the sampler's head of each response token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, sum(TOTALS), V, generator=g, dtype=torch.float64)
    tokens, masks, adv, old, rollout, ids, heads, offset = [], [], [], [], [], [], [], 0
    for total, response in zip(TOTALS, RESPONSES, strict=True):
        seq = torch.randint(0, V, (total,), generator=g)
        rows = logits[0, offset + total - response - 1 : offset + total - 1] / TEMPERATURE
        # the sampler: the trainer's distribution perturbed (a mismatched engine), its top-k recorded
        q = torch.log_softmax(rows + 0.4 * torch.randn(rows.shape, generator=g, dtype=torch.float64), -1)
        top = q.topk(K, -1).indices
        head_q = q.gather(-1, top)
        head_q[0, -1] = -torch.inf  # an empty slot: the engine returned k - 1 entries
        seq[-response:][1] = top[1, 0]  # one sampled token in the head; the others wherever they fall
        tokens.append(seq)
        masks.append(torch.ones(response, dtype=torch.int32))
        adv.append(torch.randn(response, generator=g, dtype=torch.float64))
        lp = torch.log_softmax(rows, -1).gather(-1, seq[-response:, None])[:, 0]
        old.append(lp + 0.05 * torch.randn(response, generator=g, dtype=torch.float64))
        rollout.append(q.gather(-1, seq[-response:, None])[:, 0])
        ids.append(top.to(torch.int32))
        heads.append(head_q.float().double())  # SGLang's float32 values
        offset += total
    masks[1][-1] = 0  # a masked response token
    batch = {
        "unconcat_tokens": tokens,
        "total_lengths": TOTALS,
        "response_lengths": RESPONSES,
        "loss_masks": masks,
        "advantages": adv,
        "log_probs": old,
        "rollout_log_probs": rollout,
        "rollout_topk_token_ids": ids,
        "rollout_topk_log_probs": heads,
    }
    return {"logits": logits, "batch": batch}


def head_args(flags: dict, keys: dict, **more) -> argparse.Namespace:
    values = {
        "loss_type": "custom_loss",
        "advantage_estimator": "grpo",
        "eps_clip": 0.2,
        "rollout_temperature": TEMPERATURE,
        "calculate_per_token_loss": True,
        "use_score_centering": True,
        "score_centering_top_k": K,
        "nemo_is": keys,
        **flags,
        **more,
    }
    return argparse.Namespace(**values)


def _slime(case: dict, args: argparse.Namespace):
    x = case["logits"].clone().requires_grad_(True)
    _, loss, metrics = loss_function(
        SlimePolicyLoss(), args, case["batch"], x, num_microbatches=1, step_global_batch_size=3
    )
    loss.backward()
    return loss.detach(), x.grad, metrics


def _padded(case: dict) -> tuple[torch.Tensor, dict]:
    """The same tokens as NeMo-RL-style [B, S] data (position s holds token s and its head)."""
    b, s, batch = len(TOTALS), max(TOTALS), case["batch"]
    logits = torch.zeros(b, s, V, dtype=torch.float64)
    data = {k: torch.zeros(b, s, dtype=torch.float64) for k in ("token_mask", "advantages", "prev_logprobs")}
    data["generation_logprobs"] = torch.zeros(b, s, dtype=torch.float64)
    data["input_ids"] = torch.zeros(b, s, dtype=torch.long)
    data["rollout_topk_ids"] = torch.zeros(b, s, K, dtype=torch.long)
    data["rollout_topk_logprobs"] = torch.full((b, s, K), -torch.inf, dtype=torch.float64)
    offset = 0
    for i, (total, response) in enumerate(zip(TOTALS, RESPONSES, strict=True)):
        logits[i, :total] = case["logits"][0, offset : offset + total]
        data["input_ids"][i, :total] = batch["unconcat_tokens"][i]
        r = slice(total - response, total)
        data["token_mask"][i, r] = batch["loss_masks"][i].double()
        data["advantages"][i, r] = batch["advantages"][i]
        data["prev_logprobs"][i, r] = batch["log_probs"][i]
        data["generation_logprobs"][i, r] = batch["rollout_log_probs"][i]
        data["rollout_topk_ids"][i, r] = batch["rollout_topk_token_ids"][i].long()
        data["rollout_topk_logprobs"][i, r] = batch["rollout_topk_log_probs"][i]
        offset += total
    data["sample_mask"] = torch.ones(b, dtype=torch.float64)
    return logits / TEMPERATURE, data


def _plugin(case: dict, cfg: ClippedPGLossConfig):
    logits, data = _padded(case)
    x = logits.clone().requires_grad_(True)
    n = data["token_mask"].sum()
    loss, metrics = ClippedPGLoss(cfg)(None, data, 1.0, n, logits=x)
    n = n + EPS  # token-mean's denominator
    loss.backward()
    # back to slime's packed rows: d/d(z) of softmax(z / T) at the packed logits
    grad, offset = torch.zeros_like(case["logits"]), 0
    for i, total in enumerate(TOTALS):
        grad[0, offset : offset + total] = x.grad[i, :total] / TEMPERATURE
        offset += total
    return loss.detach(), grad, metrics, n


@pytest.mark.parametrize("name", list(SETTINGS))
def test_slime_head_equals_the_plugins_loss(name):
    flags, keys = SETTINGS[name]
    case = head_case()
    args = head_args(flags, keys)
    loss, grad, metrics = _slime(case, args)
    slime_cfg = policy_config(args, keys)
    assert slime_cfg.score_centering and slime_cfg.score_centering_top_k == K
    cfg = ClippedPGLossConfig(**{**given_keys(slime_cfg), "loss_aggregation": "token-mean"})
    want_loss, want_grad, want, n = _plugin(case, cfg)
    torch.testing.assert_close(loss / n, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad / n, want_grad, rtol=1e-10, atol=1e-12)
    for short in SC_METRICS:
        key = f"score_centering_{short}"
        torch.testing.assert_close(metrics["nemo_is/" + key] / n, torch.as_tensor(want[key]).double(), msg=key)
    torch.testing.assert_close(
        metrics["nemo_is/score_centering_loss"] / n, torch.as_tensor(want["score_centering_loss"]).double()
    )
    # upstream slime's names: Q_H and P_H are 1 - the tails; the term is A * sc_correction, which it is not for A = 1
    torch.testing.assert_close(
        metrics["sc_sampler_head_mass"] / n, 1 - torch.as_tensor(want["score_centering_sampler_tail"]).double()
    )
    assert float(metrics["nemo_is/score_centering_drift"]) > 1e-3  # the sampler differs: the term is not 0
    assert 0 < float(metrics["nemo_is/score_centering_sampled_in_head"]) < float(n)


def test_a_missing_head_is_named():
    case = head_case()
    del case["batch"]["rollout_topk_log_probs"]
    with pytest.raises(KeyError, match="rollout_topk_log_probs"):
        _slime(case, head_args({}, {}))


class DiskRef:
    """Stands for slime's ``DiskTensorRef`` (a spilled head): indexable, not a tensor."""

    def __getitem__(self, index):
        return self


def test_a_spilled_head_is_refused():
    case = head_case()
    case["batch"]["rollout_topk_token_ids"][1] = DiskRef()
    with pytest.raises(TypeError, match="disk reference"):
        _slime(case, head_args({}, {}))


def test_head_rows_must_match_the_responses():
    case = head_case()
    batch = case["batch"]
    batch["rollout_topk_log_probs"][0] = batch["rollout_topk_log_probs"][0][1:]  # 3 rows for a 4-token response
    with pytest.raises(ValueError, match="rollout_topk_log_probs"):  # slime's call, no sharding model in between
        SlimePolicyLoss()(head_args({}, {}), batch, case["logits"], sum_of_sample_mean(batch, 0, 1, True))


def test_the_plugin_key_alone_turns_it_on_with_k_from_the_batch():
    case = head_case()
    on_flag = _slime(case, head_args({}, {}))
    on_key = _slime(
        case, head_args({}, {"score_centering": True}, use_score_centering=False, score_centering_top_k=None)
    )
    off = _slime(case, head_args({}, {}, use_score_centering=False))
    torch.testing.assert_close(on_key[0], on_flag[0], rtol=0, atol=0)
    assert abs(float(on_flag[0] - off[0])) > 1e-4


@pytest.mark.parametrize(
    ("flags", "match"),
    [({"rollout_top_k": 20}, "--rollout-top-k"), ({"rollout_top_p": 0.9}, "--rollout-top-p")],
)
def test_sampling_that_invalidates_the_head_is_refused(flags, match):
    with pytest.raises(ConfigError, match=match):  # top-k: the sampler check; top-p: slime's replay, refused first
        policy_config(head_args(flags, {}), {})


def test_sglang_original_logprobs_at_another_temperature_are_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ScoreCenteringSamplerError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        policy_config(head_args({}, {}), {})
