"""YAML recipes -> ClippedPGLossConfig through OmegaConf: sections, inheritance, overrides, interpolation, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_is_plugin.adapters.recipes import (
    RecipeError,
    load_loss_spec,
    load_recipe_config,
    load_yaml,
    loss_section,
    to_loss_mapping,
)
from nemo_is_plugin.config import STRICT_KEYS_ENV, UnknownConfigKeyWarning
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "examples").glob("*.yaml"))

MASTER = """
grpo:
  max_len: 4096
policy:
  broken: ${oc.env:NEMO_IS_SURELY_UNSET_VAR}
loss_fn:
  name: nemo_is.clipped_pg
  use_importance_sampling_correction: true
  ratio_clip_min: 0.2
  ratio_clip_max: ${.ratio_clip_min}
  token_level_loss: false
  loss_aggregation: seq-mean-token-sum-norm
  loss_aggregation_norm: ${grpo.max_len}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def master(tmp_path) -> Path:
    return _write(tmp_path, "master.yaml", MASTER)


def test_master_config_reads_only_loss_fn_and_resolves_interpolations(master):
    spec = load_loss_spec(master)
    assert spec.name == "nemo_is.clipped_pg"
    cfg = spec.config
    # ${.ratio_clip_min} is relative, ${grpo.max_len} reaches outside the section; policy.broken is never resolved.
    assert cfg.ratio_clip_max == 0.2 and cfg.loss_aggregation_norm == 4096.0
    assert cfg.effective_loss_aggregation == "seq-mean-token-sum-norm"
    assert cfg.is_correction_level is None


def test_one_line_override_changes_only_that_field(master):
    base = load_recipe_config(master)
    changed = load_recipe_config(master, ["loss_fn.is_correction_level=sequence_mean"])
    assert changed.is_correction_level == "sequence_mean" and changed.effective_is_level == "sequence_mean"
    assert base.model_dump() | {"is_correction_level": "sequence_mean"} == changed.model_dump()


def test_overrides_parse_values_like_a_cli(master):
    cfg = load_recipe_config(
        master,
        [
            "loss_fn.ratio_clip_c=3",
            "loss_fn.use_importance_sampling_correction=false",
            "loss_fn.kl_input_clamp_value=null",
            "grpo.max_len=100",
        ],
    )
    assert cfg.ratio_clip_c == 3.0 and cfg.use_importance_sampling_correction is False
    assert cfg.kl_input_clamp_value is None
    assert cfg.loss_aggregation_norm == 100.0  # an override elsewhere flows through the interpolation


def test_override_syntax_add_force_delete(master):
    cfg = load_yaml(master, ["+grpo.extra=1", "++grpo.max_len=8", "++grpo.new=2", "~policy.broken"])
    assert cfg.grpo.extra == 1 and cfg.grpo.max_len == 8 and cfg.grpo.new == 2 and "broken" not in cfg.policy
    with pytest.raises(RecipeError, match=r"'grpo.max_len' already exists"):
        load_yaml(master, ["+grpo.max_len=1"])
    with pytest.raises(RecipeError, match="cannot delete 'grpo.nope'"):
        load_yaml(master, ["~grpo.nope"])
    with pytest.raises(RecipeError, match="not of the form key=value"):
        load_yaml(master, ["grpo.max_len"])


def test_unknown_override_key_is_refused_with_a_hint(master):
    with pytest.raises(
        RecipeError,
        match=r"'ratio_clip_mn' is not a loss_fn key \(did you mean "
        r"'loss_fn.ratio_clip_min'\?\)",
    ):
        load_yaml(master, ["loss_fn.ratio_clip_mn=0.3"])
    with pytest.raises(
        RecipeError,
        match=r"'grpo.max_lne=3' matches no key of the config \(did you mean "
        r"'grpo.max_len'\?\); use \+grpo.max_lne=\.\.\. to add",
    ):
        load_yaml(master, ["grpo.max_lne=3"])
    # a loss field absent from the file is still a known key
    assert load_recipe_config(master, ["loss_fn.clip_position_power=0.0"]).clip_position_power == 0.0


@pytest.mark.parametrize("override", ["ratio_clip_max=0.3", "policy.ratio_clip_max=0.3", "grpo.ratio_clip_max=0.3"])
def test_a_loss_key_outside_the_loss_section_is_refused_naming_the_right_key(master, override):
    """The reported case: without the ``loss_fn.`` prefix the override used to be silently ignored."""
    with pytest.raises(RecipeError, match=r"matches no key of the config \(did you mean 'loss_fn.ratio_clip_max'\?\)$"):
        load_recipe_config(master, [override])
    with pytest.raises(RecipeError, match="did you mean 'loss_fn.ratio_clip_max'"):
        load_recipe_config(ROOT / "configs" / "geo_rs_tis.yaml", ["ratio_clip_max=0.3"])


@pytest.mark.parametrize("override", ["+loss_fn.foo=1", "++loss_fn.foo=1", "loss_fn.foo.bar=1", "~loss_fn.foo"])
def test_every_prefix_is_refused_for_a_non_loss_key_inside_the_section(master, override):
    with pytest.raises(RecipeError, match=r"'foo(\.bar)?' is not a loss_fn key"):
        load_yaml(master, [override])


def test_a_key_the_section_already_holds_may_be_overridden_even_if_no_loss_key(tmp_path):
    """NeMo-RL sections may carry extra keys of the host; changing one is an instruction that matches something."""
    path = _write(tmp_path, "extra.yaml", "loss_fn:\n  host_extra: 1\n")
    cfg = load_yaml(path, ["loss_fn.host_extra=2"])
    assert cfg.loss_fn.host_extra == 2
    assert "host_extra" not in load_yaml(path, ["~loss_fn.host_extra"]).loss_fn


def test_bare_section_files_take_loss_keys_with_or_without_the_prefix(tmp_path):
    bare = _write(tmp_path, "bare.yaml", "ratio_clip_min: 0.15\n")
    assert load_recipe_config(bare, ["ratio_clip_max=0.3"]).ratio_clip_max == 0.3
    cfg = load_recipe_config(bare, ["loss_fn.ratio_clip_max=0.4"])
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max) == (0.15, 0.4)  # the file's own keys are kept
    with pytest.raises(RecipeError, match="'ratio_clip_mx' is not a loss_fn key"):
        load_recipe_config(bare, ["ratio_clip_mx=0.3"])
    empty = _write(tmp_path, "empty.yaml", "")
    assert load_recipe_config(empty, ["loss_fn.ratio_clip_max=0.5"]).ratio_clip_max == 0.5
    empty_section = _write(tmp_path, "empty_section.yaml", "loss_fn:\n")
    assert load_recipe_config(empty_section, ["loss_fn.ratio_clip_max=0.6"]).ratio_clip_max == 0.6


def test_override_values_go_through_omegaconf(master):
    cfg = load_yaml(master, ["grpo.max_len=[1, 2]", "++grpo.d={a: 1}", "grpo.max_len=${grpo.d.a}"])
    assert cfg.grpo.max_len == 1 and cfg.grpo.d.a == 1  # the interpolation resolves
    with pytest.raises(RecipeError, match="not a dotted key"):
        load_yaml(master, ["grpo..x=1"])
    with pytest.raises(RecipeError, match="not a dotted key"):
        load_yaml(master, ["=1"])


def test_name_is_checked_against_the_registry(master):
    with pytest.raises(RecipeError, match=r"unknown loss 'nemo_is\.clipped'\. Did you mean 'nemo_is\.clipped_pg'\?"):
        load_loss_spec(master, ["loss_fn.name=nemo_is.clipped"])
    with pytest.raises(RecipeError, match="must be a string"):
        load_loss_spec(master, ["loss_fn.name=3"])


def test_invalid_values_name_the_file_section_and_key(master):
    with pytest.raises(RecipeError, match=r"(?s)master.yaml: invalid 'loss_fn' section.*is_correction_level"):
        load_recipe_config(master, ["loss_fn.is_correction_level=bogus"])
    # an override is an explicit instruction: one that names no loss key is refused, strict mode or not
    with pytest.raises(RecipeError, match=r"'foo' is not a loss_fn key"):
        load_recipe_config(master, ["+loss_fn.foo=1"])


def test_unknown_keys_in_the_file_warn_and_are_refused_in_strict_mode(tmp_path, monkeypatch):
    """NeMo-RL accepts extra loss_fn keys: one written in the recipe warns by default, naming the nearest key."""
    path = _write(tmp_path, "extra.yaml", "loss_fn:\n  ratio_clip_mx: 0.3\n")
    with pytest.warns(UnknownConfigKeyWarning, match=r"'ratio_clip_mx' \(did you mean 'ratio_clip_max'\?\)"):
        assert load_recipe_config(path).ratio_clip_max == 0.2
    monkeypatch.setenv(STRICT_KEYS_ENV, "1")
    with pytest.raises(RecipeError, match=r"unknown loss_fn key\(s\): 'ratio_clip_mx'"):
        load_recipe_config(path)


def test_defaults_inheritance_child_wins(tmp_path):
    _write(tmp_path, "base.yaml", "loss_fn:\n  ratio_clip_min: 0.1\n  ratio_clip_max: 0.3\n")
    _write(tmp_path, "mid.yaml", "defaults: base.yaml\nloss_fn:\n  ratio_clip_max: 0.4\n")
    child = _write(tmp_path, "child.yaml", "defaults: [mid.yaml]\nloss_fn:\n  ratio_clip_c: 3.0\n")
    cfg = load_recipe_config(child)
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.1, 0.4, 3.0)


def test_cyclic_and_hydra_style_defaults_are_refused(tmp_path):
    _write(tmp_path, "a.yaml", "defaults: b.yaml\nx: 1\n")
    b = _write(tmp_path, "b.yaml", "defaults: a.yaml\ny: 1\n")
    with pytest.raises(RecipeError, match="cyclic 'defaults' chain"):
        load_yaml(b)
    hydra = _write(tmp_path, "h.yaml", "defaults:\n  - trainer: base\nloss_fn: {}\n")
    with pytest.raises(RecipeError, match="'defaults' must be a path or a list of paths"):
        load_yaml(hydra)


def test_bare_section_file_and_empty_section(tmp_path):
    bare = _write(tmp_path, "bare.yaml", "name: nemo_is.clipped_pg\nratio_clip_min: 0.15\n")
    spec = load_loss_spec(bare)
    assert spec.name == "nemo_is.clipped_pg" and spec.config.ratio_clip_min == 0.15
    empty = _write(tmp_path, "empty.yaml", "policy: {a: 1}\nloss_fn:\n")
    assert load_recipe_config(empty) == ClippedPGLossConfig()


def test_missing_section_lists_top_level_keys(tmp_path):
    path = _write(tmp_path, "nolo.yaml", "grpo: {a: 1}\npolicy: {b: 2}\n")
    with pytest.raises(RecipeError, match=r"no 'loss_fn' section in the config \(top-level keys: grpo, policy\)"):
        load_recipe_config(path)


def test_other_section_paths_and_sources(master):
    cfg = OmegaConf.create({"actor": {"policy_loss": {"nemo_is": {"ratio_clip_min": 0.05}}}})
    assert load_recipe_config(cfg, section="actor.policy_loss.nemo_is").ratio_clip_min == 0.05
    changed = load_recipe_config(cfg, ["actor.policy_loss.nemo_is.ratio_clip_min=0.5"], "actor.policy_loss.nemo_is")
    assert changed.ratio_clip_min == 0.5 and cfg.actor.policy_loss.nemo_is.ratio_clip_min == 0.05  # caller untouched
    assert load_recipe_config({"loss_fn": {"ratio_clip_min": 0.07}}).ratio_clip_min == 0.07
    assert to_loss_mapping(master)["loss_aggregation_norm"] == 4096
    assert to_loss_mapping(None) == {}
    with pytest.raises(RecipeError, match="cannot resolve 'policy'"):
        loss_section(load_yaml(master), "policy")


def test_file_errors(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_yaml(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="is a directory; a recipe is a YAML file"):
        load_yaml(tmp_path)
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(RecipeError, match=r"model.bin: not a text file \(byte \d+ is not UTF-8\)"):
        load_yaml(binary)
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_yaml(_write(tmp_path, "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(RecipeError, match="a recipe is a YAML path or a mapping"):
        load_yaml(3)


def test_env_interpolation_with_default(tmp_path, monkeypatch):
    path = _write(tmp_path, "env.yaml", "loss_fn:\n  ratio_clip_min: ${oc.env:NEMO_IS_TEST_CLIP,0.25}\n")
    assert load_recipe_config(path).ratio_clip_min == 0.25
    monkeypatch.setenv("NEMO_IS_TEST_CLIP", "0.125")
    assert load_recipe_config(path).ratio_clip_min == 0.125


# where a recipe keeps the plugin's keys, when not in loss_fn (the verl example is verl's Hydra config)
SECTIONS = {"verl_ctpo_seqmean.yaml": "actor_rollout_ref.actor.policy_loss.nemo_is"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_in_configs_loads(recipe):
    spec = load_loss_spec(recipe, section=SECTIONS.get(recipe.name, "loss_fn"))
    assert isinstance(spec.config, ClippedPGLossConfig)
    assert spec.name == "nemo_is.clipped_pg"
