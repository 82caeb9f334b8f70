"""Score centering's demand on the rollout engine, checked where an adapter can see the host's sampling settings.

Score centering subtracts the sampler's expected score over its recorded top-k head (docs/score_centering.md). The
head must therefore be the distribution the engine actually sampled from: full-vocabulary log-probs after temperature
and every processor (vLLM ``logprobs_mode: processed_logprobs``), with no truncation the trainer does not model. Each
setting below changes the sampled distribution away from the recorded one or from ``softmax(z / T)`` of the trainer,
so the centring coefficients (q_v f(p_v / q_v) - alpha p_v) no longer centre the score the loss uses:

- ``top_k`` (not -1 / None / 0), ``top_p`` < 1, ``min_p`` > 0: truncated sampling; the head's tail model (the sampler's
  tail proportional to the trainer's) is wrong where the sampler's tail is 0 (exact-support centring, which vime and
  prime-rl use for top-p, is not implemented);
- ``repetition_penalty`` != 1, ``presence_penalty`` / ``frequency_penalty`` != 0, a ``logit_bias``: the sampler's
  logits depend on the context in a way the trainer's softmax does not reproduce;
- the rollout temperature differs from the trainer's: q and p are then softmaxes of differently scaled logits;
- ``logprobs_mode`` other than ``processed_logprobs`` (vLLM's default is ``raw_logprobs``: before temperature and
  processors), unless the temperature is 1 and nothing else processes the logits (then raw = processed);
- ``max_logprobs`` below k: vLLM rejects ``SamplingParams(logprobs=k)`` above its engine cap (default 20).

:func:`sampler_refusals` returns one line per problem, naming the host's own key; an adapter raises
:class:`ScoreCenteringSamplerError` with them (:func:`check_sampler`). Hosts spell the keys differently, hence
``names`` (the NeMo-RL and slime spellings are :data:`NEMO_RL_NAMES` and :data:`SLIME_NAMES`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from nemo_is_plugin.config import ConfigError

VLLM_DEFAULT_MAX_LOGPROBS = 20  # vllm/config/model.py, ModelConfig.max_logprobs
PROCESSED = "processed_logprobs"

# NeMo-RL's generation config (nemo_rl/models/generation/interfaces.py GenerationConfig, vllm/config.py VllmConfig):
# what vllm_worker.py reads for its SamplingParams and LLM(...) (NeMo-RL @7ea279ab).
NEMO_RL_NAMES = {
    "temperature": "policy.generation.temperature",
    "top_k": "policy.generation.top_k",
    "top_p": "policy.generation.top_p",
    "logprobs_mode": "policy.generation.vllm_cfg.logprobs_mode",
    "max_logprobs": "policy.generation.vllm_kwargs.max_logprobs",
    "bad_words": "policy.generation.bad_words",
}
# slime's rollout flags (slime/utils/arguments.py @624b824a).
SLIME_NAMES = {
    "temperature": "--rollout-temperature",
    "top_k": "--rollout-top-k",
    "top_p": "--rollout-top-p",
}


class ScoreCenteringSamplerError(ConfigError):
    """The rollout engine's settings make its recorded head differ from the distribution it sampled from."""


def _off(value: Any, neutral: float) -> bool:
    return value is not None and float(value) != neutral


def sampler_refusals(
    settings: Mapping[str, Any],
    names: Mapping[str, str],
    *,
    head_k: int | None = None,
    trainer_temperature: float | None = None,
    engine: str = "vllm",
) -> list[str]:
    """One line per sampling setting that invalidates score centering's head (module docstring); empty: none.

    ``settings``: the host's values under the neutral names ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``logprobs_mode``,
    ``max_logprobs``, ``bad_words`` (absent or None: the engine's default). ``names``: the host's spelling of each
    (the neutral name where missing). ``head_k``: the head size k (score_centering_top_k), when known.
    ``engine``: ``vllm`` checks vLLM's ``logprobs_mode`` and ``max_logprobs`` too.
    """

    def name(key: str) -> str:
        return names.get(key, key)

    out: list[str] = []
    why = "score centering needs the head of the distribution the engine sampled from"
    top_k = settings.get("top_k")
    if top_k is not None and int(top_k) not in (-1, 0):
        out.append(f"{name('top_k')}={top_k}: {why}, and top-k truncates it (set -1)")
    for key, neutral, fix in (
        ("top_p", 1.0, "1.0"),
        ("min_p", 0.0, "0"),
        ("repetition_penalty", 1.0, "1.0"),
        ("presence_penalty", 0.0, "0"),
        ("frequency_penalty", 0.0, "0"),
    ):
        if _off(settings.get(key), neutral):
            out.append(f"{name(key)}={settings[key]}: {why}, which {key} changes (set {fix})")
    if settings.get("logit_bias"):
        out.append(f"{name('logit_bias')} is set: {why}, which a logit bias shifts (remove it)")
    temperature = settings.get("temperature")
    if temperature is not None and (not math.isfinite(float(temperature)) or float(temperature) <= 0):
        out.append(f"{name('temperature')}={temperature}: score centering needs stochastic sampling (temperature > 0)")
    if temperature is not None and trainer_temperature is not None and float(temperature) != trainer_temperature:
        out.append(
            f"{name('temperature')}={temperature} while the trainer scales its logits by {trainer_temperature}: the "
            "head's q and the trainer's p must be softmaxes of the same temperature"
        )
    if engine == "vllm":
        mode = settings.get("logprobs_mode") or "raw_logprobs"
        raw_is_processed = (temperature is None or float(temperature) == 1.0) and not settings.get("bad_words")
        if mode != PROCESSED and not (mode == "raw_logprobs" and raw_is_processed):
            out.append(
                f"{name('logprobs_mode')}={mode!r}: vLLM then returns log-probs before temperature and processors; "
                f"score centering needs {PROCESSED!r}"
            )
        cap = settings.get("max_logprobs")
        cap = VLLM_DEFAULT_MAX_LOGPROBS if cap is None else int(cap)
        if head_k is not None and cap != -1 and cap < head_k:
            out.append(
                f"{name('max_logprobs')}={cap} (vLLM's default is {VLLM_DEFAULT_MAX_LOGPROBS}) is below the head size "
                f"k={head_k}: vLLM refuses SamplingParams(logprobs={head_k}); raise it to at least {head_k}"
            )
    if engine == "sglang" and settings.get("return_original_logprob") and temperature is not None:
        if float(temperature) != 1.0:
            out.append(
                f"SGLANG_RETURN_ORIGINAL_LOGPROB is set with {name('temperature')}={temperature}: SGLang then returns "
                "log-probs before the temperature; score centering needs the temperature-scaled ones (unset it)"
            )
    return out


def check_sampler(
    settings: Mapping[str, Any],
    names: Mapping[str, str],
    *,
    head_k: int | None = None,
    trainer_temperature: float | None = None,
    engine: str = "vllm",
) -> None:
    """Raise :class:`ScoreCenteringSamplerError` listing :func:`sampler_refusals`, one line each."""
    problems = sampler_refusals(settings, names, head_k=head_k, trainer_temperature=trainer_temperature, engine=engine)
    if problems:
        raise ScoreCenteringSamplerError("; ".join(problems))


def slime_sampling(args: Any) -> dict[str, Any]:
    """slime's rollout flags (``--rollout-temperature``, ``--rollout-top-k``, ``--rollout-top-p``) as
    :func:`sampler_refusals` settings, with SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (log-probs before the
    temperature) from the environment."""
    flag = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower() in ("1", "true")
    return {
        "temperature": getattr(args, "rollout_temperature", None),
        "top_k": getattr(args, "rollout_top_k", None),
        "top_p": getattr(args, "rollout_top_p", None),
        "return_original_logprob": flag,
    }


def nemo_rl_generation_settings(generation: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """NeMo-RL's ``policy.generation`` section as :func:`sampler_refusals` settings, and its backend."""
    vllm_cfg = generation.get("vllm_cfg") or {}
    vllm_kwargs = generation.get("vllm_kwargs") or {}
    settings = {
        "temperature": generation.get("temperature"),
        "top_k": generation.get("top_k"),
        "top_p": generation.get("top_p"),
        "logprobs_mode": vllm_cfg.get("logprobs_mode"),
        "max_logprobs": vllm_kwargs.get("max_logprobs"),
        "bad_words": generation.get("bad_words"),
    }
    return settings, str(generation.get("backend") or "vllm")


__all__ = [
    "NEMO_RL_NAMES",
    "PROCESSED",
    "SLIME_NAMES",
    "VLLM_DEFAULT_MAX_LOGPROBS",
    "ScoreCenteringSamplerError",
    "check_sampler",
    "nemo_rl_generation_settings",
    "sampler_refusals",
    "slime_sampling",
]
