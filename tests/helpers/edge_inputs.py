"""Edge inputs of the loss, and what docs/config.md ("Edge inputs") promises for each under a given config.

The base batch (NeMo-RL's layout, ``[B, S] = [4, 8]``, column 0 the prompt's last token, never read) holds four kinds
of rows: row 0 with 7 valid tokens, row 1 with 5 and 2 of padding, row 2 with one token, row 3 a sample masked out
(``sample_mask = 0``). Its log-probs sit close together (|p - g| ~ 0.05), so that every truncation band and rejection
rule of ``helpers.config_space`` keeps most tokens and an edge value is the only thing out of the ordinary.

Each :class:`EdgeInput` changes one thing: a non-finite or huge generation / prev / reference log-prob on a valid
token, on a padding token or in the masked-out sample; slightly positive log-probs; an empty row; one-token rows; an
all-masked micro-batch; a NaN advantage. :func:`expectation` says what the docs promise for it under a config:

- ``ok``: finite loss and gradient, no NaN metric (NeMo-RL's mismatch metrics excepted where the docs say so);
- ``same``: exactly the base batch's loss, gradient and metrics (a masked token never changes anything);
- ``zero``: an all-masked batch: loss 0, gradient 0;
- ``refused``: a ``ValueError`` of one line naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nemo_is_plugin import ClippedPGLossConfig
from nemo_is_plugin.loss.objectives import objective_of

B, S = 4, 8
VALID, FIRST, ONE = (0, 4), (1, 1), (2, 1)  # [B, S] coordinates of valid tokens: mid-row, first of row 1, row 2's only
PAD, SAMPLE_MASKED = (1, 7), (3, 3)  # a padding token (token_mask 0), a token of the masked-out sample
HUGE = -120.0  # a log-prob 120 nats below the others: |log r| >= 100 against each of them
KEYS = {"gen": "generation_logprobs", "prev": "prev_logprobs", "ref": "reference_policy_logprobs"}
HEAD_K = 3  # score centering's head size (helpers.config_space: score_centering_top_k)
HEAD_KEYS = ("rollout_topk_logprobs", "curr_topk_logprobs")


def base_batch(dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(next_token_logprobs [B, S-1], data of [B, S] tensors, [B] masks and rewards)."""
    g = torch.Generator().manual_seed(seed)

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(B, S, generator=g, dtype=torch.float64) * scale

    prev = -(torch.rand(B, S, generator=g, dtype=torch.float64) * 1.9 + 0.1)
    token_mask = torch.ones(B, S)
    token_mask[:, 0] = 0
    token_mask[1, 6:] = 0
    token_mask[2, 2:] = 0
    data = {
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        "advantages": noise(1.0).to(dtype),
        "prev_logprobs": prev.to(dtype),
        "generation_logprobs": (prev + noise(0.05)).clamp(max=-1e-3).to(dtype),
        "reference_policy_logprobs": (prev + noise(0.1)).clamp(max=-1e-3).to(dtype),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    }
    curr = (prev + noise(0.03)).clamp(max=-1e-3)[:, 1:].to(dtype)
    # score centering's head (read with score_centering only): ids, the sampler's [B, S, K] and the trainer's
    # [B, S-1, K] log-probs, each of the K head tokens with probability in [0.05, 0.25]
    head_q = torch.log(0.05 + 0.2 * torch.rand(B, S, HEAD_K, generator=g, dtype=torch.float64))
    data["rollout_topk_ids"] = torch.arange(HEAD_K).expand(B, S, HEAD_K).clone()
    data["rollout_topk_logprobs"] = head_q.to(dtype)
    data["curr_topk_logprobs"] = (head_q[:, 1:] + noise(0.05)[:, 1:, None]).clamp(max=-1e-3).to(dtype)
    return curr, data


@dataclass(frozen=True)
class EdgeInput:
    """One change of the base batch: ``apply(curr, data)`` mutates clones in place."""

    name: str
    apply: Callable[[torch.Tensor, dict[str, torch.Tensor]], None]
    key: str | None = None  # the data key changed, for the value edges
    value: float | None = None
    where: str | None = None  # valid | pad | sample_masked | structure
    positions: tuple[tuple[int, int], ...] = field(default=())

    def batch(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        curr, data = base_batch(dtype)
        curr, data = curr.clone(), {k: v.clone() for k, v in data.items()}
        self.apply(curr, data)
        return curr, data


def _set(key: str, positions: tuple[tuple[int, int], ...], value: float):
    def apply(curr: torch.Tensor, data: dict[str, torch.Tensor]) -> None:
        for i, j in positions:
            data[key][i, j] = value

    return apply


def _value_edges() -> list[EdgeInput]:
    out = []
    where = {"valid": (VALID,), "pad": (PAD,), "sample_masked": (SAMPLE_MASKED,)}
    for short, key in KEYS.items():
        for value_name, value in (("-inf", -math.inf), ("+inf", math.inf), ("nan", math.nan), ("huge", HUGE)):
            for place, positions in where.items():
                out.append(
                    EdgeInput(
                        f"{short}={value_name}@{place}", _set(key, positions, value), key, value, place, positions
                    )
                )
    gen = KEYS["gen"]
    for name, positions in (("first", (FIRST,)), ("one_token_row", (ONE,)), ("two_rows", (VALID, FIRST))):
        out.append(EdgeInput(f"gen=-inf@{name}", _set(gen, positions, -math.inf), gen, -math.inf, "valid", positions))

    def inf_and_nan(curr, data):
        data[gen][VALID] = -math.inf
        data[gen][0, 6] = math.nan

    out.append(EdgeInput("gen=-inf+nan@same_row", inf_and_nan, gen, -math.inf, "valid", (VALID, (0, 6))))
    return out


def _other_edges() -> list[EdgeInput]:
    def rounding(curr, data):  # log_softmax rounding: +1e-6 on certain tokens, every log-prob tensor
        curr[VALID[0], VALID[1] - 1] = 1e-6
        for key in KEYS.values():
            data[key][VALID] = 1e-6

    def log3_prev(curr, data):  # NeMo-RL's own tests use log 3
        data["prev_logprobs"][VALID] = math.log(3.0)

    def log3_curr(curr, data):
        curr[VALID[0], VALID[1] - 1] = math.log(3.0)

    def empty_row(curr, data):
        data["token_mask"][2] = 0

    def one_token_rows(curr, data):
        data["token_mask"][:, 2:] = 0

    def no_tokens(curr, data):
        data["token_mask"].zero_()

    def no_samples(curr, data):
        data["sample_mask"].zero_()

    def nan_advantage(curr, data):
        data["advantages"][VALID] = math.nan

    def head(key: str, position: tuple[int, int], value: float):
        def apply(curr, data):  # every slot of the token's head; curr_topk_logprobs is [B, S-1, K] already aligned
            i, j = position
            data[key][i, j - (key == "curr_topk_logprobs")] = value

        return apply

    head_edges = [
        EdgeInput(f"{short}={name}@{place}", head(key, pos, value), key, value, place, (pos,))
        for short, key in (("head_q", "rollout_topk_logprobs"), ("head_p", "curr_topk_logprobs"))
        for name, value in (("nan", math.nan), ("-inf", -math.inf))
        for place, pos in (("valid", VALID), ("pad", PAD))
    ]
    return [
        *head_edges,
        EdgeInput("positive_rounding", rounding, where="valid"),
        EdgeInput("prev=log3@valid", log3_prev, "prev_logprobs", math.log(3.0), "valid", (VALID,)),
        EdgeInput("curr=log3@valid", log3_curr, None, math.log(3.0), "valid", (VALID,)),
        EdgeInput("empty_row", empty_row, where="structure"),
        EdgeInput("one_token_rows", one_token_rows, where="structure"),
        EdgeInput("all_tokens_masked", no_tokens, where="structure"),
        EdgeInput("all_samples_masked", no_samples, where="structure"),
        EdgeInput("advantage=nan@valid", nan_advantage, "advantages", math.nan, "valid", (VALID,)),
    ]


EDGE_INPUTS: tuple[EdgeInput, ...] = (EdgeInput("clean", lambda c, d: None), *_value_edges(), *_other_edges())


def reads(cfg: ClippedPGLossConfig, key: str) -> bool:
    """Whether the loss of ``cfg`` reads the data tensor ``key`` (an unread tensor is neither checked nor used)."""
    if key == "prev_logprobs":
        return not cfg.force_on_policy_ratio and not cfg.bypasses_prev
    if key == "reference_policy_logprobs":
        return cfg.effective_kl_penalty != 0
    if key in HEAD_KEYS:
        return cfg.score_centering
    return True


def old_policy_key(cfg: ClippedPGLossConfig) -> str | None:
    """The data tensor the policy ratio divides by (None: the ratio is 1, or there is none)."""
    if cfg.force_on_policy_ratio:
        return None
    return "generation_logprobs" if cfg.bypasses_prev else "prev_logprobs"


def ratio_overflows(cfg: ClippedPGLossConfig, dtype: torch.dtype) -> bool:
    """Whether a HUGE old log-prob at VALID (log r ~ 119 at the 4th of 7 tokens) overflows a ratio that the surrogate
    differentiates: float32 (exp overflows above 88.7; float64 above 709), PPO's clip in ratio or log space, at the
    token or cumulative level (the sequence mean is ~17, the cumulative mean ~30), without max_log_ratio."""
    return (
        dtype != torch.float64
        and objective_of(cfg).differentiates_ratio(cfg)
        and cfg.effective_ratio_level in ("token", "cumulative")
        and cfg.max_log_ratio is None
    )


@dataclass(frozen=True)
class Expectation:
    outcome: str  # ok | same | zero | refused
    tensor: str | None = None  # the tensor a refusal names


def expectation(cfg: ClippedPGLossConfig, edge: EdgeInput, dtype: torch.dtype = torch.float64) -> Expectation:
    """What docs/config.md promises for ``edge`` under ``cfg`` with log-probs of ``dtype``."""
    strict = cfg.strict_input_checks
    if edge.name in ("all_tokens_masked", "all_samples_masked"):
        return Expectation("zero")
    if edge.name == "advantage=nan@valid":
        return Expectation("refused", "advantages")
    if edge.name == "prev=log3@valid":
        return Expectation("refused" if strict and reads(cfg, "prev_logprobs") else "ok", "prev_logprobs")
    if edge.name == "curr=log3@valid":
        return Expectation("refused" if strict else "ok", "next_token_logprobs")
    if edge.key is None or edge.key == "advantages":
        return Expectation("ok")
    if not reads(cfg, edge.key):
        return Expectation("same")
    if edge.key in HEAD_KEYS:
        # score centering reads the head of counted tokens only; a sampler's -inf is an empty slot (all empty: no
        # term), anything else non-finite there is refused, as is a trainer -inf in a slot the sampler fills
        if edge.where != "valid" or (edge.key == "rollout_topk_logprobs" and edge.value == -math.inf):
            return Expectation("same" if edge.where != "valid" else "ok")
        return Expectation("refused", edge.key)
    anchor = edge.key == old_policy_key(cfg)
    finite = edge.value is not None and math.isfinite(edge.value)
    if not finite and (strict or edge.key != "generation_logprobs" or anchor):
        # the strict mode refuses every non-finite log-prob; the default tolerates the generation's only, unless they
        # are pi_old (old_policy_logprobs: generation)
        return Expectation("refused", edge.key)
    if edge.where != "valid":
        return Expectation("same")
    if anchor and edge.value == HUGE and ratio_overflows(cfg, dtype):
        return Expectation("refused", edge.key)
    return Expectation("ok")
