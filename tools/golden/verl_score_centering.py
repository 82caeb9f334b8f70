"""Regenerate the verl score-centering golden suite (tests/data/golden/verl_score_centering) from a verl checkout.

    python -m tools.golden.verl_score_centering --repo /path/to/verl --out /tmp/verl_score_centering [--check]
    python -m tools.golden.verl_score_centering --repo /path/to/verl --out DIR --init   # (re)build the case set

verl's score centering (verl-project/verl PR #8010, ``verl/trainer/ppo/score_centering.py``) runs in two places of
its FSDP actor: a logits processor computes the per-token centring term from the trainer logits and the sampler's
top-k head (``score_centering_logits_processor``: ``score_centering_weight_fn``, ``topk_log_probs_from_logits``,
``score_centering_correction``), and the bypass-mode REINFORCE loss adds ``advantages * sc_correction``
(``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_bypass_mode`` -> ``compute_policy_loss_reinforce``).
Each case stores verl's own config (``rollout_correction`` with ``score_centering: true``, ``loss_agg_mode``,
``global_batch_info``) and the response-aligned inputs; this calls, from the checkout, in float32 on CPU:

1. ``log_prob = verl.utils.torch_functional.logprobs_from_logits(logits, responses)`` (the actor's forward);
2. ``score_centering_logits_processor(logits, TensorDict(rollout_topk_ids, rollout_topk_log_probs), config)`` with
   the heads as jagged nested tensors, one row per sequence (verl's thd layout, response rows only);
3. ``compute_policy_loss_bypass_mode(old_log_prob=rollout_log_probs, log_prob, advantages, response_mask,
   loss_agg_mode, config, sc_correction=...)`` with a real ``verl.workers.config.ActorConfig``;

and writes ``expected = {loss, grad_logits, metrics, ppo_loss_metrics}`` (``grad_logits`` = d loss / d logits through
both the label log-prob and the head), or ``{error: {raises, message}}``. ``metrics`` are exactly what step 3
returns; ``ppo_loss_metrics`` are the three that verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) adds around
it for score centering, which the stored corpus did not hold at the suite's commit: they are computed here as verl's
own test ``tests/trainer/ppo/test_score_centering_loss_on_cpu.py::test_ppo_loss_applies_score_centering_end_to_end``
states them (``actor/pg_loss`` = the loss; ``actor/sc_sampler_head_mass`` / ``actor/sc_train_head_mass`` = the
response-mask mean of the processor's masses).

Stubs: ``transformers`` only (the checkout names classes the installed release removed; nothing here calls it), as
tools/golden/verl_rollout_corr.py. verl runs from the checkout, unchanged. ``--init`` writes the case set that
:func:`build_cases` draws (configs and inputs, seeded) with the reference's outputs, for a new suite or a new case list.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tools.golden import checkout, common

COMMIT = "c6236f515b81792e476e75377947519f3ca00666"
ACTOR_SETUP = {"strategy": "fsdp", "rollout_n": 1, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1}
TRAINER_METRICS = ("actor/pg_loss", "actor/sc_sampler_head_mass", "actor/sc_train_head_mass")


def make_regenerate(repo: Path) -> common.Regenerate:
    checkout.install_stubs(always=["transformers"])
    checkout.use_checkout(repo, "verl")
    from tensordict import TensorDict  # type: ignore[import-untyped]
    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode
    from verl.trainer.ppo.score_centering import score_centering_logits_processor
    from verl.utils.torch_functional import logprobs_from_logits
    from verl.workers.config import ActorConfig, PolicyLossConfig

    def actor_config(params: dict) -> Any:
        cfg = ActorConfig(
            **ACTOR_SETUP,
            loss_agg_mode=params["loss_agg_mode"],
            policy_loss=PolicyLossConfig(
                loss_mode="bypass_mode", rollout_correction=dict(params["rollout_correction"])
            ),
        )
        cfg.global_batch_info.update(params["global_batch_info"])
        return cfg

    def nested(rows: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor(list(rows.unbind(0)), layout=torch.jagged)

    def regenerate(case: dict) -> dict:
        params, inputs = case["params"], case["inputs"]
        cfg = actor_config(params)
        logits = inputs["logits"].clone().requires_grad_(True)
        b, t, v = logits.shape
        mask = inputs["response_mask"].bool()
        heads = TensorDict(
            {
                "rollout_topk_ids": nested(inputs["rollout_topk_ids"]),
                "rollout_topk_log_probs": nested(inputs["rollout_topk_log_probs"]),
            },
            batch_size=[b],
        )
        try:
            log_prob = logprobs_from_logits(logits.reshape(b * t, v), inputs["responses"].reshape(-1)).view(b, t)
            sc = score_centering_logits_processor(logits.reshape(1, b * t, v), heads, cfg)
            loss, metrics = compute_policy_loss_bypass_mode(
                old_log_prob=inputs["rollout_log_probs"],
                log_prob=log_prob,
                advantages=inputs["advantages"],
                response_mask=mask,
                loss_agg_mode=params["loss_agg_mode"],
                config=cfg,
                sc_correction=sc["sc_correction"].view(b, t),
            )
        except (TypeError, ValueError, AssertionError) as exc:
            return {"error": {"raises": common.error_name(exc), "message": str(exc)}}
        (grad,) = torch.autograd.grad(loss, logits)
        n = mask.sum().clamp_min(1)
        trainer = {
            "actor/pg_loss": loss.detach(),
            "actor/sc_sampler_head_mass": (sc["sc_sampler_head_mass"].view(b, t) * mask).sum() / n,
            "actor/sc_train_head_mass": (sc["sc_train_head_mass"].view(b, t) * mask).sum() / n,
        }
        return {
            "loss": loss.detach(),
            "grad_logits": grad,
            "metrics": common.to_metrics(metrics),
            "ppo_loss_metrics": common.to_metrics(trainer),
        }

    return regenerate


# ------------------------------------------------------------------------------------------------ inputs


def draw_inputs(spec: dict, generator: torch.Generator) -> dict:
    """Trainer logits N(0, 2^2); sampler logits those plus N(0, sigma^2); the sampler's top-k head (ids by
    descending sampler probability, full-vocabulary log-probs); the sampled token drawn from the sampler (or forced
    outside the head at a ``outside`` fraction of positions); advantages one N(0,1) value per row, 0 where masked.
    Masked positions carry verl's dummy head (ids 0..k-1, log-probs -log k)."""
    b, t, v, k = spec["B"], spec["T"], spec["V"], spec["k"]
    logits = common.normal((b, t, v), generator, 2.0)
    sampler = torch.log_softmax((logits + common.normal((b, t, v), generator, spec["sigma"])).double(), -1)
    head_lp, head_ids = sampler.topk(k, dim=-1)
    flat = sampler.exp().reshape(-1, v)
    responses = torch.multinomial(flat, 1, generator=generator).view(b, t)
    outside = torch.rand((b, t), generator=generator) < spec.get("outside", 0.0)
    for i, j in outside.nonzero().tolist():
        rest = [x for x in range(v) if x not in set(head_ids[i, j].tolist())]
        responses[i, j] = rest[int(torch.randint(len(rest), (1,), generator=generator))]
    rollout_lp = sampler.gather(-1, responses[..., None])[..., 0]
    head_lp = head_lp.float()
    head_ids = head_ids.to(torch.int32)
    pad = spec.get("neg_inf_slots", 0)
    if pad:  # the last `pad` slots of every other position: -inf, with an id no head slot of that position holds
        for i in range(b):
            for j in range(0, t, 2):
                free = [x for x in range(v) if x not in set(head_ids[i, j].tolist())]
                head_ids[i, j, k - pad :] = free[0]
                head_lp[i, j, k - pad :] = -math.inf
    mask = torch.zeros(b, t)
    for i, n in enumerate(spec["lengths"]):
        mask[i, :n] = 1.0
    for i, j in spec.get("interior_zeros", []):
        mask[i, j] = 0.0
    dummy = torch.arange(k, dtype=torch.int32).expand(b, t, k)
    head_ids = torch.where(mask.bool()[..., None], head_ids, dummy)
    head_lp = torch.where(mask.bool()[..., None], head_lp, torch.full_like(head_lp, -math.log(k)))
    advantages = common.normal((b, 1), generator).expand(b, t) * mask
    return {
        "logits": logits,
        "responses": responses,
        "rollout_log_probs": rollout_lp.float(),
        "rollout_topk_ids": head_ids.contiguous(),
        "rollout_topk_log_probs": head_lp.contiguous(),
        "advantages": advantages.contiguous(),
        "response_mask": mask,
    }


def rollout_correction(rollout_is: str | None, threshold: Any = 2.0, **extra: Any) -> dict:
    return {
        "bypass_mode": True,
        "loss_type": extra.pop("loss_type", "reinforce"),
        "rollout_is": rollout_is,
        "rollout_is_threshold": threshold,
        "rollout_is_batch_normalize": False,
        "rollout_rs": extra.pop("rollout_rs", None),
        "rollout_rs_threshold": extra.pop("rollout_rs_threshold", None),
        "score_centering": True,
    }


NONE, TIS, ICEPOP = rollout_correction(None), rollout_correction("token", 2.0), rollout_correction("token", "0.5_5.0")
BASE = {"B": 3, "T": 7, "V": 48, "k": 8, "sigma": 0.3, "lengths": [7, 5, 6]}
# (description, rollout_correction, loss_agg_mode, trainer's global_batch_info (True) or local counts (False), spec)
CASES: list[tuple[str, dict, str, bool, dict]] = [
    ("SC alone (rollout_is None), token-mean", NONE, "token-mean", True, {}),
    ("SC + TIS C=2, token-mean", TIS, "token-mean", True, {}),
    ("SC + IcePop 0.5_5.0, token-mean", ICEPOP, "token-mean", True, {}),
    ("SC + TIS, seq-mean-token-mean", TIS, "seq-mean-token-mean", True, {}),
    ("SC alone, seq-mean-token-sum", NONE, "seq-mean-token-sum", True, {}),
    ("SC + IcePop, token-sum", ICEPOP, "token-sum", True, {}),
    ("SC + TIS, seq-mean-token-sum-norm (horizon T)", TIS, "seq-mean-token-sum-norm", True, {}),
    ("SC + TIS, local counts (global_batch_info unset)", TIS, "token-mean", False, {}),
    ("SC + TIS, -inf head slots (last 3 of every other position)", TIS, "token-mean", True, {"neg_inf_slots": 3}),
    ("SC alone, -inf head slots", NONE, "seq-mean-token-mean", True, {"neg_inf_slots": 3}),
    ("SC + IcePop, -inf head slots", ICEPOP, "token-mean", True, {"neg_inf_slots": 3}),
    (
        "SC + IcePop, sampled token outside the head at ~half the positions",
        ICEPOP,
        "token-mean",
        True,
        {"outside": 0.5},
    ),
    (
        "SC + TIS, sampled token outside the head, seq-mean-token-mean",
        TIS,
        "seq-mean-token-mean",
        True,
        {"outside": 0.5},
    ),
    ("SC alone, sampled token outside the head", NONE, "token-mean", True, {"outside": 0.5}),
    (
        "SC + TIS, an empty row and interior zeros",
        TIS,
        "token-mean",
        True,
        {"lengths": [7, 0, 6], "interior_zeros": [(0, 2), (2, 4)]},
    ),
    ("SC alone, an empty row, seq-mean-token-mean", NONE, "seq-mean-token-mean", True, {"lengths": [0, 5, 6]}),
    (
        "SC + IcePop, an empty row, local counts, seq-mean-token-sum",
        ICEPOP,
        "seq-mean-token-sum",
        False,
        {"lengths": [4, 0, 7]},
    ),
    ("SC + TIS, strong mismatch (sigma 1.5)", TIS, "token-mean", True, {"sigma": 1.5}),
    ("SC + IcePop, strong mismatch (sigma 1.5)", ICEPOP, "token-mean", True, {"sigma": 1.5}),
    ("SC + TIS C=1.2 (string threshold '1.2')", rollout_correction("token", "1.2"), "token-mean", True, {"sigma": 0.8}),
    (
        "SC + TIS + token_k1 rejection 0.5_2.0",
        rollout_correction("token", 2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
        "token-mean",
        True,
        {"sigma": 1.0},
    ),
    ("SC alone, k = 1", NONE, "token-mean", True, {"k": 1}),
    ("SC + TIS, k = 32 of V = 48", TIS, "token-mean", True, {"k": 32}),
    (
        "error: rollout_is='sequence' (score centering composes with token-level IS only)",
        rollout_correction("sequence", 2.0),
        "token-mean",
        True,
        {},
    ),
    (
        "error: bypass loss_type='ppo_clip' with score centering",
        rollout_correction(None, loss_type="ppo_clip"),
        "token-mean",
        True,
        {},
    ),
]


def global_batch_info(inputs: dict, trainer: bool) -> dict:
    """What verl's ``ppo_loss`` sets from the batch (one DP rank: ``dp_size`` 1, ``batch_num_tokens`` the response
    tokens, ``global_batch_size`` the rows), or all None (verl's own SC tests: local counts in ``agg_loss``)."""
    if not trainer:
        return {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None}
    mask = inputs["response_mask"]
    return {
        "dp_size": 1,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": int(mask.shape[0]),
        "loss_scale_factor": None,
    }


def build_cases() -> list[dict]:
    cases = []
    for i, (description, rc, agg, trainer, extra) in enumerate(CASES):
        spec = {**BASE, **extra}
        inputs = draw_inputs(spec, torch.Generator().manual_seed(1000 + i))
        cases.append(
            {
                "id": f"case_{i:03d}",
                "description": description,
                "source": {
                    "repo": "verl-project/verl",
                    "commit": COMMIT,
                    "file": "verl/trainer/ppo/score_centering.py; verl/trainer/ppo/core_algos.py",
                    "function": "score_centering_logits_processor; compute_policy_loss_bypass_mode",
                },
                "params": {
                    "rollout_correction": rc,
                    "loss_agg_mode": agg,
                    "global_batch_info": global_batch_info(inputs, trainer),
                    "topk_log_probs": spec["k"],
                    "seed": 1000 + i,
                    "generator": {k: v for k, v in spec.items() if k not in ("interior_zeros",)}
                    | {"interior_zeros": [list(p) for p in spec.get("interior_zeros", [])]},
                    "dtype": "float32",
                    "device": "cpu",
                },
                "inputs": inputs,
            }
        )
    return cases


def redraw(case: dict, generator: torch.Generator, seed: int, template: str) -> dict:
    """New inputs on a case's config and generator options (masks and head layout from its spec)."""
    spec = dict(case["params"]["generator"])
    spec["interior_zeros"] = [tuple(p) for p in spec.get("interior_zeros", [])]
    case["inputs"] = draw_inputs(spec, generator)
    trainer = case["params"]["global_batch_info"]["batch_num_tokens"] is not None
    case["params"]["global_batch_info"] = global_batch_info(case["inputs"], trainer)
    case["params"]["seed"] = seed
    case["description"] = f"fresh inputs (seed {seed}) on {template}'s config: {case['description']}"
    return case


def tolerance(case: dict, path: tuple[str, ...]) -> common.Tolerance:
    """Suite README, "Tolerances": loss, gradient and metrics rtol 1e-5 / atol 1e-6."""
    return 1e-5, 1e-6


SUITE = common.Suite("verl_score_centering", "verl-project/verl", COMMIT, make_regenerate, tolerance, redraw)


def init(argv: Sequence[str]) -> int:
    """``--repo R --out D --init``: write :func:`build_cases` with the reference's outputs to D."""
    args = dict(zip(argv[::2], argv[1::2]))
    regenerate = make_regenerate(Path(args["--repo"]))
    out = Path(args["--out"])
    for case in build_cases():
        common.seed_everything(case["params"]["seed"])
        common.save_case({**case, "expected": regenerate(case)}, out / f"{case['id']}.pt")
    print(f"verl_score_centering: wrote {len(CASES)} cases to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--init" in argv:
        argv.remove("--init")
        return init(argv)
    return common.run(SUITE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
