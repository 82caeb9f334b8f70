"""The verl loss-mode golden cases (tests/data/golden/verl_loss_modes) as compositions of the plugin's functions:
a trust mask or ratio level, a surrogate, and the plugin's aggregation. This is the wiring each verl ``loss_mode``
needs; tests/loss/test_objectives.py checks it against verl's own numbers."""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_is_plugin.loss.aggregation import aggregate
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives.base import SurrogateOut
from nemo_is_plugin.loss.objectives.cispo import cispo_surrogate
from nemo_is_plugin.loss.objectives.dppo import binary_kl_mask, binary_tv_mask, divergence_pg_surrogate
from nemo_is_plugin.loss.objectives.dro import dro_surrogate
from nemo_is_plugin.loss.objectives.gmpo import gmpo_surrogate
from nemo_is_plugin.loss.objectives.gpg import gpg_surrogate
from nemo_is_plugin.loss.objectives.ppo_clip import ratio_clip_surrogate
from nemo_is_plugin.loss.objectives.sapo import sapo_surrogate
from nemo_is_plugin.loss.ratios import policy_log_ratio, token_log_ratio

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "golden" / "verl_loss_modes"
# verl clamps the token log-ratio at +-20 before exponentiating (vanilla, cispo, dppo_*, sapo).
VERL_LOG_RATIO_CLAMP = 20.0
# verl's GSPO caps the combined sequence log-ratio at 10.
VERL_GSPO_MAX_LOG_RATIO = 10.0
# Modes whose aggregation verl fixes whatever loss_agg_mode says.
FORCED_AGGREGATION = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def load_cases() -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(GOLDEN_DIR.glob("case_*.pt"))]


def surrogate_for(case: dict, curr: torch.Tensor, inp: dict, layout: TokenLayout) -> SurrogateOut:
    """The plugin's per-token surrogate for the case's verl loss mode (``inp``: the case's inputs, on curr's device)."""
    mode, cfg = case["mode"], case["config"]
    old, adv, mask = inp["old_log_prob"], inp["advantages"], inp["response_mask"]
    low, high = cfg["clip_ratio_low"], cfg["clip_ratio_high"]
    d = token_log_ratio(curr, old, VERL_LOG_RATIO_CLAMP)
    if mode == "vanilla":
        return ratio_clip_surrogate(d, adv, clip_low=low, clip_high=high, dual_clip=cfg["clip_ratio_c"])
    if mode == "gspo":
        log_r = policy_log_ratio("sequence_token", curr, old, mask, layout, max_log_ratio=VERL_GSPO_MAX_LOG_RATIO)
        return ratio_clip_surrogate(log_r, adv, clip_low=low, clip_high=high, dual_clip=None)
    if mode == "cispo":
        return cispo_surrogate(d, curr, adv, clip_low=low, clip_high=high)
    if mode in ("dppo_tv", "dppo_kl"):
        rule = binary_tv_mask if mode == "dppo_tv" else binary_kl_mask
        trust = rule(curr.detach(), old, adv, delta_low=low, delta_high=high)
        return divergence_pg_surrogate(d, curr, adv, trust, ratio_cap=cfg["clip_ratio_c"])
    if mode == "sapo":
        return sapo_surrogate(d, adv, tau_pos=cfg["tau_pos"], tau_neg=cfg["tau_neg"])
    if mode == "geo_mean":
        return gmpo_surrogate(curr, old, adv, mask, layout, clip_low=low, clip_high=high)
    if mode == "gpg":
        return gpg_surrogate(curr, adv)
    if mode == "dro":
        return dro_surrogate(curr, old, adv, beta=cfg["dro_beta"])
    raise ValueError(f"no plugin composition for verl loss_mode {mode!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x.to(mask.dtype) * mask).sum() / mask.sum()


def verl_metrics(case: dict, out: SurrogateOut, curr: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
    """verl's metric names from the plugin's indicators, as 0-d tensors (no host read); {} for the modes without."""
    mode, mask = case["mode"], inputs["response_mask"]
    if mode == "gpg":
        return {}
    ppo_kl = _masked_mean(-(curr.detach() - inputs["old_log_prob"]), mask)
    if mode == "dro":
        return {"actor/ppo_kl": ppo_kl}
    none = torch.zeros_like(curr, dtype=torch.bool)  # verl's 0 where the objective has no such clip
    if mode == "geo_mean":
        clipfrac, lower = out.clipped_high, out.clipped_low
    elif mode in ("dppo_tv", "dppo_kl", "vanilla"):
        clipfrac, lower = out.clipped, out.dual_clipped
    else:  # gspo, cispo, sapo report no lower fraction; sapo (a soft gate) no clip fraction
        clipfrac, lower = out.clipped, None
    clipfrac, lower = (none if x is None else x for x in (clipfrac, lower))
    return {
        "actor/pg_clipfrac": _masked_mean(clipfrac, mask),
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": _masked_mean(lower, mask),
    }


def objective_loss(
    case: dict, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, d loss / d log_prob, verl-named metrics as 0-d tensors) of the plugin's composition for one case, on
    ``device``, the log-probs cast to ``dtype`` when given. No host read, every tensor on ``device``."""
    logprob_keys = ("old_log_prob", "log_prob")
    inputs = {
        k: v.to(device=device, dtype=dtype if dtype is not None and k in logprob_keys else v.dtype)
        for k, v in case["inputs"].items()
    }
    mask = inputs["response_mask"]
    B, T = mask.shape
    layout = TokenLayout.padded(B, T, device=device)
    curr = inputs["log_prob"].clone().requires_grad_(True)
    out = surrogate_for(case, curr, inputs, layout)
    loss = aggregate(
        out.loss,
        mask,
        torch.ones(B, device=mask.device),
        layout,
        mode=FORCED_AGGREGATION.get(case["mode"], case["loss_agg_mode"]),
        global_valid_toks=mask.sum(),
        global_valid_seqs=(mask.sum(-1) > 0).sum().to(mask.dtype),
        norm=float(T),
    )
    (grad,) = torch.autograd.grad(loss, curr)
    return loss.detach(), grad, verl_metrics(case, out, curr, inputs)


def plugin_loss(case: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """:func:`objective_loss` on the CPU in the case's dtype, metrics as floats."""
    loss, grad, metrics = objective_loss(case)
    return loss, grad, {k: float(v) for k, v in metrics.items()}
