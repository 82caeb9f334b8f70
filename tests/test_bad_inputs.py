"""The bad-input battery: every wrong setting and bad file a user can hand the plugin is refused with a message that
names the culprit and the fix -- exit status 2 and no traceback on the command line, a clear exception in Python --
and nothing is written half-way. One place, so that a regression of any of them shows up here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import nemo_is_plugin
from nemo_is_plugin.adapters import nemo_rl
from nemo_is_plugin.adapters.recipes import RecipeError
from nemo_is_plugin.apps.cli.main import app
from nemo_is_plugin.apps.cli.synthetic_batch import synthetic_batch
from nemo_is_plugin.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GEO_RS = ROOT / "configs" / "geo_rs_tis.yaml"


def cli(*args) -> CliRunner.invoke:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})


def refused(result, *phrases: str) -> str:
    """A clean refusal: exit status 2, every phrase in the message, no traceback."""
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in text
    for phrase in phrases:
        assert phrase in text, (phrase, text)
    return text


def recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(body)
    return path


# ------------------------------------------------------------------ wrong settings that used to pass silently
@pytest.mark.parametrize(
    "line, key",
    [
        ("ratio_clip_max: -0.5", "ratio_clip_max=-0.5"),
        ("ratio_clip_min: -0.2", "ratio_clip_min=-0.2"),
        ("ratio_clip_min: 1.5", "ratio_clip_min=1.5"),
        ("reference_policy_kl_penalty: -0.1", "reference_policy_kl_penalty=-0.1"),
        ("kl_input_clamp_value: -1", "kl_input_clamp_value=-1"),
        ("max_log_ratio: -1.0", "max_log_ratio=-1"),
        ("clip_position_power: 5", "clip_position_power=5"),
        ("positive_example_nll_weight: -0.5", "positive_example_nll_weight=-0.5"),
    ],
)
def test_an_out_of_range_setting_is_refused_naming_the_key(tmp_path, line, key):
    refused(cli("validate", recipe(tmp_path, f"loss_fn:\n  {line}\n")), key, "is outside its valid range", "use ")


@pytest.mark.parametrize(
    "override, hint",
    [
        ("ratio_clip_max=0.3", "did you mean 'loss_fn.ratio_clip_max'?"),
        ("loss_fn.ratio_clip_mx=0.3", "did you mean 'loss_fn.ratio_clip_max'?"),
        ("+loss_fn.bogus_key=1", "'bogus_key' is not a loss_fn key"),
    ],
)
def test_an_override_that_matches_nothing_is_refused(override, hint):
    refused(cli("validate", GEO_RS, "-o", override), hint)
    with pytest.raises(RecipeError, match=hint.replace("?", r"\?").replace(".", r"\.")):
        nemo_rl.build_nemo_rl_loss_fn(GEO_RS, [override])


def test_an_unregistered_loss_name_is_refused_everywhere(tmp_path):
    path = recipe(tmp_path, "loss_fn:\n  name: nemo_is.clipped\n")
    refused(cli("validate", path), "unknown loss 'nemo_is.clipped'", "Did you mean 'nemo_is.clipped_pg'?")
    for build in (nemo_is_plugin.build_loss_fn, nemo_rl.build_nemo_rl_loss_fn):
        with pytest.raises(ConfigError, match="unknown loss 'nemo_is.clipped'"):
            build({"name": "nemo_is.clipped"})


# ------------------------------------------------------------------ bad files and options: a message, exit 2
def test_a_directory_as_recipe(tmp_path):
    refused(cli("validate", tmp_path), "is a directory; a recipe is a YAML file")


def test_a_binary_file_as_recipe(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)))
    refused(cli("validate", path), "not a text file", "is not UTF-8")


def test_a_missing_recipe(tmp_path):
    refused(cli("validate", tmp_path / "nope.yaml"), "recipe file not found")


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--batch-size", "0"], "--batch-size=0: the synthetic batch needs at least 1 sequence"),
        (["--seq-len", "4"], "--seq-len=4 is too short"),
        (["--mismatch-std", "-1"], "--mismatch-std=-1.0 must be >= 0"),
    ],
)
def test_validate_options(args, phrase):
    refused(cli("validate", GEO_RS, *args), phrase)


def test_a_corrupt_gzip_dump_writes_nothing(tmp_path):
    dump = tmp_path / "g.jsonl.gz"
    dump.write_bytes(b"\x1f\x8b\x08\x00garbagegarbage")
    refused(
        cli("diagnose", dump, "--json", tmp_path / "r.json", "--write-config", tmp_path / "c.yaml"), "corrupt gzip data"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl.gz"]  # no plots, no JSON, no config


def test_diagnose_output_path_that_is_a_directory_writes_nothing(tmp_path):
    from nemo_is_plugin.apps.diagnose import synthetic_records, write_dump

    dump = write_dump(synthetic_records(8, min_len=4, max_len=20, seed=0), tmp_path / "d" / "rollouts.jsonl")
    refused(cli("diagnose", dump, "--write-config", tmp_path), "--write-config", "is a folder; give a file path")
    assert not (tmp_path / "d" / "diagnose").exists()


def test_diagnose_plot_directory_that_is_a_file_writes_nothing(tmp_path):
    from nemo_is_plugin.apps.diagnose import synthetic_records, write_dump

    dump = write_dump(synthetic_records(8, min_len=4, max_len=20, seed=0), tmp_path / "rollouts.jsonl")
    (tmp_path / "plots").write_text("not a directory")
    refused(
        cli("diagnose", dump, "--out", tmp_path / "plots", "--json", tmp_path / "r.json"),
        "--out",
        "is a file; give a folder",
    )
    assert not (tmp_path / "r.json").exists()


def test_unknown_names_in_the_other_commands():
    refused(cli("evidence", "--only", "nope"), "unknown experiment(s) ['nope']")
    refused(cli("bench", "--quick", "--path", "nope"), "unknown path(s) ['nope']")


# ------------------------------------------------------------------ the loss called with bad tensors
def _inputs(b: int = 3, s: int = 10):
    x, data = synthetic_batch(max(b, 1), s)
    return x[:b], {k: v[:b] for k, v in data.items()}


def _call(x, data):
    loss_fn = nemo_is_plugin.build_loss_fn({})
    return loss_fn(next_token_logprobs=x, data=data, global_valid_seqs=float(x.shape[0]), global_valid_toks=1.0)


def test_an_empty_batch_is_named(tmp_path):
    x, data = _inputs(b=0)
    with pytest.raises(ValueError, match=r"next_token_logprobs has shape \[0, 9\]: an empty batch"):
        _call(x, data)


def test_log_probs_as_wide_as_the_data_are_named():
    x, data = _inputs()
    full = torch.cat([x, x[:, -1:]], dim=1)  # [B, S]: one log-prob too many per row
    with pytest.raises(
        ValueError,
        match=r"next_token_logprobs has shape \[3, 10\], the shape of the \[B, S\] data "
        r"tensors; the log-probs must be \[B, S-1\] = \[3, 9\]",
    ):
        _call(full, data)
