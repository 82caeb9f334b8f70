"""Every numeric key of ClippedPGLossConfig: accepted inside its interval and on a closed end, refused on an open end
and just outside, with a message naming the key, the interval and a fix; docs/config.md lists the same intervals; the
real configs (NeMo-RL golden cases, recipes) lie inside. The keys enumerated are this package's (BUILTIN_RANGES): an
installed package's objective brings keys of its own, which its own tests check."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pydantic
import pytest
from helpers.config_cases import ACTIVATING_KEYS, BUILTIN_FIELDS, BUILTIN_RANGES
from helpers.golden_utils import load_cases
from omegaconf import OmegaConf

from nemo_is_plugin.loss.config_model import NUMERIC_RANGES, ClippedPGLossConfig

ROOT = Path(__file__).resolve().parents[2]


def _build(key: str, value: float) -> ClippedPGLossConfig:
    return ClippedPGLossConfig(**ACTIVATING_KEYS[key], **{key: value})


def _refused(key: str, value: float) -> str:
    with pytest.raises(pydantic.ValidationError) as err:
        _build(key, value)
    return str(err.value)


def test_every_numeric_field_has_a_range():
    fields = ClippedPGLossConfig.model_fields
    numeric = {n for n in BUILTIN_FIELDS if {"float", "int"} & _types(fields[n].annotation)}
    assert numeric == set(BUILTIN_RANGES) == set(ACTIVATING_KEYS)


def _types(annotation) -> set[str]:
    return {getattr(a, "__name__", str(a)) for a in typing.get_args(annotation) or (annotation,)}


def _cases() -> list[tuple[str, float, bool]]:
    """(key, value, accepted) at and around each finite end (one step out: 1e-6, or 1 for an integer key), plus one
    interior point."""
    out = []
    for key, r in BUILTIN_RANGES.items():
        step = 1 if "float" not in _types(ClippedPGLossConfig.model_fields[key].annotation) else 1e-6
        for end, is_open, outward in ((r.low, r.low_open, -1.0), (r.high, r.high_open, +1.0)):
            if end is None:
                continue
            out.append((key, end, not is_open))
            out.append((key, end + outward * step, False))
        lo = r.low if r.low is not None else (r.high - 2.0)
        hi = r.high if r.high is not None else (lo + 2.0)
        out.append((key, (lo + hi) / 2, True))
    return out


@pytest.mark.parametrize("key, value, accepted", _cases(), ids=lambda v: f"{v:g}" if isinstance(v, float) else str(v))
def test_boundary(key, value, accepted):
    if accepted:
        assert getattr(_build(key, value), key) == value
    else:
        message = _refused(key, value)
        interval = NUMERIC_RANGES[key].interval()
        assert f"{key}={value:g} is outside its valid range {interval}" in message
        assert NUMERIC_RANGES[key].fix in message


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"ratio_clip_max": -0.5}, "ratio_clip_max"),
        ({"ratio_clip_min": -0.1}, "ratio_clip_min"),
        ({"ratio_clip_min": 1.5}, "ratio_clip_min"),
        ({"reference_policy_kl_penalty": -0.1}, "reference_policy_kl_penalty"),
        ({"kl_input_clamp_value": -1}, "kl_input_clamp_value"),
    ],
)
def test_the_reported_settings_are_refused(kwargs, key):
    with pytest.raises(pydantic.ValidationError, match=re.escape(key) + r"=\S+ is outside its valid range"):
        ClippedPGLossConfig(**kwargs)


def test_null_switches_a_key_off_and_is_not_range_checked():
    cfg = ClippedPGLossConfig(kl_input_clamp_value=None, kl_output_clamp_value=None, ratio_clip_c=None)
    assert cfg.kl_input_clamp_value is None and cfg.ratio_clip_c is None


def test_range_errors_come_alone_and_all_together():
    """Two out-of-range keys are both reported; the combination checks wait until the ranges hold."""
    with pytest.raises(pydantic.ValidationError) as err:
        ClippedPGLossConfig(ratio_clip_max=-1.0, kl_output_clamp_value=0.0, log_ratio_clip_low=0.1)
    text = str(err.value)
    assert "ratio_clip_max=-1" in text and "kl_output_clamp_value=0" in text
    assert "must be set together" not in text  # the log-space pairing is checked once the ranges hold


def test_assignment_is_range_checked_too():
    cfg = ClippedPGLossConfig()
    with pytest.raises(pydantic.ValidationError, match="ratio_clip_min=2 is outside"):
        cfg.ratio_clip_min = 2.0


def test_docs_list_the_same_intervals():
    """The generic keys' intervals in docs/config.md, the policy objectives' in docs/objectives.md (each objective's
    entry holds its keys), under each file's "Valid ranges" heading."""
    listed: dict[str, str] = {}
    for doc in ("config.md", "objectives.md"):
        text = (ROOT / "docs" / doc).read_text()
        section = text.split("## Valid ranges", 1)[1].split("\n## ", 1)[0]
        for keys, interval in re.findall(r"^\| (`[^|]+`) \| `([^`]+)` \|", section, flags=re.M):
            for key in re.findall(r"`([a-z0-9_]+)`", keys):
                assert key not in listed, f"{key} listed twice"
                listed[key] = interval
    assert listed == {k: r.interval() for k, r in BUILTIN_RANGES.items()}


def test_the_json_schema_carries_each_interval_and_its_why():
    properties = ClippedPGLossConfig.model_json_schema()["properties"]
    bound = {"low": ("minimum", "exclusiveMinimum"), "high": ("maximum", "exclusiveMaximum")}
    for key, r in BUILTIN_RANGES.items():
        want = {"why": r.why, "fix": r.fix}
        for end, (closed, opened) in bound.items():
            if getattr(r, end) is not None:
                want[opened if getattr(r, f"{end}_open") else closed] = getattr(r, end)
        got = {k: v for k, v in properties[key].items() if k in want or k in sum(bound.values(), ())}
        assert got == want, key


def _numeric_values(cfg: dict) -> dict[str, float]:
    return {k: v for k, v in cfg.items() if k in NUMERIC_RANGES and isinstance(v, (int, float)) and v is not None}


def test_every_valid_nemo_rl_golden_case_is_inside_the_ranges():
    cases = [c for c in load_cases("nemo_rl") if "error" not in c["expected"]]
    assert len(cases) > 100
    for case in cases:
        for key, value in _numeric_values(case["config"]).items():
            assert NUMERIC_RANGES[key].contains(value), (case["id"], key, value)
        ClippedPGLossConfig(**case["config"])


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/**/*.yaml")), ids=lambda p: p.name)
def test_every_recipe_is_inside_the_ranges(path):
    section = OmegaConf.to_container(OmegaConf.load(path), resolve=True).get("loss_fn") or {}
    for key, value in _numeric_values(section).items():
        assert NUMERIC_RANGES[key].contains(value) and math.isfinite(value), (path.name, key, value)
