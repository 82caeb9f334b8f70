"""Score centering's refusals of rollout-engine settings (adapters/sampler_checks.py), in each host's own key names,
and where the adapters apply them: NeMo-RL's ``policy.generation`` (build_nemo_rl_loss_fn with a master config) and
slime's rollout flags (the full loss's config). NeMo-RL's key names are checked against its source when
``NEMO_RL_PATH`` names a checkout."""

from __future__ import annotations

import argparse
import ast
import os
from pathlib import Path

import pytest

from nemo_is_plugin.adapters.nemo_rl import build_nemo_rl_loss_fn
from nemo_is_plugin.adapters.sampler_checks import (
    NEMO_RL_NAMES,
    SLIME_NAMES,
    ScoreCenteringSamplerError,
    check_sampler,
    nemo_rl_generation_settings,
    sampler_refusals,
    slime_sampling,
)
from nemo_is_plugin.config import ConfigError

NEUTRAL = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "logprobs_mode": "processed_logprobs"}


def test_neutral_settings_pass_and_every_invalidating_setting_is_one_line_naming_the_key():
    assert sampler_refusals(NEUTRAL, NEMO_RL_NAMES, head_k=20) == []
    assert sampler_refusals({**NEUTRAL, "top_k": None}, NEMO_RL_NAMES) == []
    bad = {
        "top_k": 50,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.2,
        "logit_bias": {7: -100.0},
    }
    for key, value in bad.items():
        lines = sampler_refusals({**NEUTRAL, key: value}, NEMO_RL_NAMES)
        assert len(lines) == 1, (key, lines)
        assert lines[0].startswith(f"{NEMO_RL_NAMES.get(key, key)}={value}" if key != "logit_bias" else "logit_bias")
    assert len(sampler_refusals({**NEUTRAL, **bad}, NEMO_RL_NAMES)) == len(bad)


def test_temperature_must_be_positive_and_match_the_trainer():
    assert "temperature > 0" in sampler_refusals({**NEUTRAL, "temperature": 0.0}, SLIME_NAMES)[0]
    (line,) = sampler_refusals({**NEUTRAL, "temperature": 0.7}, SLIME_NAMES, trainer_temperature=1.0)
    assert line.startswith("--rollout-temperature=0.7") and "1.0" in line
    assert sampler_refusals({**NEUTRAL, "temperature": 0.7}, SLIME_NAMES, trainer_temperature=0.7) == []


def test_vllm_logprobs_mode_raw_is_refused_unless_it_equals_processed():
    raw = {**NEUTRAL, "logprobs_mode": None}  # vLLM's default: raw_logprobs
    assert sampler_refusals(raw, NEMO_RL_NAMES) == []  # T = 1, no processors: raw = processed
    (line,) = sampler_refusals({**raw, "temperature": 0.8}, NEMO_RL_NAMES)
    assert line.startswith("policy.generation.vllm_cfg.logprobs_mode='raw_logprobs'") and "processed" in line
    assert len(sampler_refusals({**raw, "bad_words": ["x"]}, NEMO_RL_NAMES)) == 1
    assert len(sampler_refusals({**NEUTRAL, "logprobs_mode": "raw_logits"}, NEMO_RL_NAMES)) == 1
    assert sampler_refusals({**raw, "temperature": 0.8}, NEMO_RL_NAMES, engine="sglang") == []


def test_vllm_max_logprobs_must_cover_the_head():
    assert sampler_refusals(NEUTRAL, NEMO_RL_NAMES, head_k=20) == []  # vLLM's default cap is 20
    (line,) = sampler_refusals(NEUTRAL, NEMO_RL_NAMES, head_k=32)
    assert line.startswith("policy.generation.vllm_kwargs.max_logprobs=20") and "32" in line
    assert sampler_refusals({**NEUTRAL, "max_logprobs": 32}, NEMO_RL_NAMES, head_k=32) == []
    assert sampler_refusals({**NEUTRAL, "max_logprobs": -1}, NEMO_RL_NAMES, head_k=128) == []  # -1: no cap


def test_check_sampler_raises_a_config_error_with_every_line():
    with pytest.raises(ScoreCenteringSamplerError) as err:
        check_sampler({**NEUTRAL, "top_k": 50, "top_p": 0.9}, NEMO_RL_NAMES)
    assert isinstance(err.value, ConfigError)
    assert "policy.generation.top_k=50" in str(err.value) and "policy.generation.top_p=0.9" in str(err.value)


def _master(**generation):
    gen = {"backend": "vllm", "temperature": 1.0, "top_p": 1.0, "top_k": None, "vllm_cfg": {}, **generation}
    return {"policy": {"generation": gen}, "loss_fn": {"score_centering": True, "score_centering_top_k": 32}}


def test_nemo_rl_master_config_is_checked_when_score_centering_is_on():
    with pytest.raises(ScoreCenteringSamplerError, match=r"policy\.generation\.top_p=0\.95"):
        build_nemo_rl_loss_fn(_master(top_p=0.95, vllm_kwargs={"max_logprobs": 64}))
    with pytest.raises(ScoreCenteringSamplerError, match=r"vllm_kwargs\.max_logprobs=20"):
        build_nemo_rl_loss_fn(_master())
    with pytest.raises(ScoreCenteringSamplerError, match=r"vllm_cfg\.logprobs_mode"):
        build_nemo_rl_loss_fn(_master(temperature=0.6, vllm_kwargs={"max_logprobs": 32}))
    # score centering off: the same generation settings are not the loss's business
    off = _master(top_p=0.95)
    off["loss_fn"] = {}
    assert build_nemo_rl_loss_fn(off) is not None


def test_nemo_rl_generation_section_reading():
    settings, backend = nemo_rl_generation_settings(
        {"backend": "sglang", "top_k": 5, "vllm_cfg": {"logprobs_mode": "processed_logprobs"}, "bad_words": None}
    )
    assert backend == "sglang" and settings["top_k"] == 5 and settings["logprobs_mode"] == "processed_logprobs"
    assert settings["max_logprobs"] is None


def test_slime_flags_and_sglang_original_logprob(monkeypatch):
    a = argparse.Namespace(rollout_temperature=0.8, rollout_top_k=-1, rollout_top_p=1.0)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    assert sampler_refusals(slime_sampling(a), SLIME_NAMES, engine="sglang") == []
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    (line,) = sampler_refusals(slime_sampling(a), SLIME_NAMES, engine="sglang")
    assert line.startswith("SGLANG_RETURN_ORIGINAL_LOGPROB") and "--rollout-temperature=0.8" in line
    a.rollout_top_k = 20
    assert any(x.startswith("--rollout-top-k=20") for x in sampler_refusals(slime_sampling(a), SLIME_NAMES))


def _typed_dict_keys(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    raise AssertionError(f"{name} not in {path}")


def test_nemo_rl_names_are_nemo_rls_generation_keys():
    root = os.environ.get("NEMO_RL_PATH")
    if not root or not (Path(root) / "nemo_rl").is_dir():
        pytest.skip("NEMO_RL_PATH does not name a NeMo-RL checkout (the directory holding nemo_rl/)")
    gen = _typed_dict_keys(Path(root) / "nemo_rl/models/generation/interfaces.py", "GenerationConfig")
    vllm = Path(root) / "nemo_rl/models/generation/vllm/config.py"
    vllm_keys = _typed_dict_keys(vllm, "VllmSpecificArgs") | _typed_dict_keys(vllm, "VllmConfig")
    for dotted in NEMO_RL_NAMES.values():
        parts = dotted.split(".")[2:]  # below policy.generation
        if parts[0] == "vllm_cfg":
            assert parts[1] in vllm_keys, dotted
        elif parts[0] == "vllm_kwargs":
            assert "vllm_kwargs" in vllm_keys | gen, dotted  # passed through to vllm.LLM(...)
        else:
            assert parts[0] in gen, dotted
