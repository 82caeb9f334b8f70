"""What the host adapters share (nemo_is_plugin/adapters/shared.py): one rule per idea, checked on the config space.

``owns_correction`` was written twice before the adapters became packages: slime's counted any truncation type, verl's
only the rejection types and added bypass mode. On a valid config the truncation tests agree (the config refuses tis,
icepop and seq-mask-tis without ``use_importance_sampling_correction``), so the one rule is slime's; verl's bypass term
is the separate question "does the loss read log mu" (``reads_rollout_logprobs``). Both are checked against the two
former rules on every config of the covering grid, so neither host's behaviour moved.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.config_space import build, config_grid, row_id

from nemo_is_plugin import ClippedPGLossConfig
from nemo_is_plugin.adapters import HOSTS
from nemo_is_plugin.adapters.shared import (
    PARALLEL_STATE,
    MissingPluginConfigError,
    check_groups,
    given_keys,
    owns_correction,
    reads_rollout_logprobs,
    renormalize,
    resolve_groups,
)
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups

ROWS = config_grid().rows


def _slime_rule(cfg: ClippedPGLossConfig) -> bool:  # adapters/slime.py before the packages
    return (
        cfg.use_importance_sampling_correction
        or cfg.truncated_importance_sampling_type is not None
        or bool(cfg.rejection_rules)
        or cfg.importance_sampling_veto_threshold is not None
    )


def _verl_rule(cfg: ClippedPGLossConfig) -> bool:  # adapters/verl_correction.py before the packages
    return (
        cfg.use_importance_sampling_correction
        or cfg.truncated_importance_sampling_type in ("seq-mis", "geo-rs")
        or bool(cfg.rejection_rules)
        or cfg.importance_sampling_veto_threshold is not None
        or cfg.bypasses_prev
    )


@pytest.mark.parametrize("row", ROWS, ids=[row_id(r) for r in ROWS])
def test_one_rule_keeps_both_hosts_behaviour_on_the_config_space(row):
    cfg = build(row)
    assert owns_correction(cfg) == _slime_rule(cfg)
    assert reads_rollout_logprobs(cfg) == _verl_rule(cfg)


def test_where_the_former_rules_were_written_differently():
    """A rejection truncation type without IS weights: both rules own the correction. Bypass mode alone: the plugin
    computes no correction (slime computes none), but the loss reads log mu (verl reports its rollout_corr/ statistics,
    as verl's bypass loss does). A tis truncation needs IS on, so both rules read it through that switch."""
    geo_rs = ClippedPGLossConfig(
        truncated_importance_sampling_type="geo-rs",
        truncated_importance_sampling_ratio=1.25,
        truncated_importance_sampling_ratio_min=0.8,
    )
    assert owns_correction(geo_rs) and reads_rollout_logprobs(geo_rs)
    bypass = ClippedPGLossConfig(old_policy_logprobs="generation")
    assert not owns_correction(bypass) and reads_rollout_logprobs(bypass)
    assert _slime_rule(bypass) == owns_correction(bypass) and _verl_rule(bypass) == reads_rollout_logprobs(bypass)
    assert not owns_correction(ClippedPGLossConfig()) and not reads_rollout_logprobs(ClippedPGLossConfig())


def test_groups_spec():
    check_groups(PARALLEL_STATE, allow_none=False)
    check_groups(None, allow_none=True)
    check_groups(ParallelGroups(), allow_none=False)
    with pytest.raises(ValueError, match="groups must be 'parallel_state' or a ParallelGroups, got None"):
        check_groups(None, allow_none=False)
    with pytest.raises(ValueError, match="groups must be None, a ParallelGroups or 'parallel_state', got 'mpu'"):
        check_groups("mpu", allow_none=True)
    explicit = ParallelGroups(pp_is_last=False)
    assert resolve_groups(explicit) is explicit
    assert resolve_groups(None) == ParallelGroups()
    # megatron-core is installed in the test venv but not initialised here: no groups, no communication
    assert resolve_groups(PARALLEL_STATE) == ParallelGroups()


def test_given_keys():
    assert given_keys(None) == {}
    assert given_keys({"ratio_clip_min": 0.1, "name": "x"}) == {"ratio_clip_min": 0.1, "name": "x"}
    cfg = ClippedPGLossConfig(ratio_clip_min=0.1, use_importance_sampling_correction=True)
    assert given_keys(cfg) == {"ratio_clip_min": 0.1, "use_importance_sampling_correction": True}
    with pytest.raises(TypeError, match="cfg must be"):
        given_keys(3)
    assert issubclass(MissingPluginConfigError, RuntimeError)


def test_renormalize_divides_by_the_new_counts():
    from nemo_is_plugin.loss.denominator import Denominator
    from nemo_is_plugin.loss.metrics import MetricValues

    denominators = {"t": Denominator.TOKENS, "s": Denominator.SEQUENCES, "n": Denominator.NONE}
    values = MetricValues({"t": 1.0, "s": 2.0, "n": 3.0}, denominators)
    out = renormalize(values, tokens=(10.0, 4.0), seqs=(6.0, 0.0))
    assert out == {"t": 2.5, "s": 0.0, "n": 3.0}


def test_the_hosts_and_their_entry_points():
    """adapters/__init__ names every host; each entry point it names is an attribute of the host's package."""
    import importlib

    assert set(HOSTS) == {"nemo_rl", "verl", "slime"}
    for package, names in HOSTS.values():
        module = importlib.import_module(package)
        assert all(callable(getattr(module, name)) for name in names), package


def test_importing_the_adapters_imports_no_host():
    """The adapters package, its shared module and the three host packages import neither verl, megatron-core,
    NeMo-RL nor slime (each is read lazily, where a host runs)."""
    code = (
        "import sys, nemo_is_plugin.adapters, nemo_is_plugin.adapters.shared, nemo_is_plugin.adapters.nemo_rl, "
        "nemo_is_plugin.adapters.verl, nemo_is_plugin.adapters.slime; "
        "print(sorted(m for m in ('verl', 'megatron', 'nemo_rl', 'slime') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_nemo_rl_head_imports_without_the_loss_function():
    """The start-up hook imports ``nemo_rl.head`` while NeMo-RL imports its model_utils: that import must not reach
    ``protocol``, which imports NeMo-RL's loss interfaces (and would fall back to look-alike enums if NeMo-RL were
    half-imported). The package's names still resolve afterwards."""
    code = (
        "import sys\n"
        "from nemo_is_plugin.adapters.nemo_rl import head\n"
        "print(sorted(m for m in sys.modules if m.startswith('nemo_is_plugin.adapters.nemo_rl.')))\n"
        "from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn, PARALLEL_STATE\n"
        "print(NeMoRLLossFn.__module__, PARALLEL_STATE)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "['nemo_is_plugin.adapters.nemo_rl.head']"
    assert out[1] == "nemo_is_plugin.adapters.nemo_rl.loss_fn parallel_state"
