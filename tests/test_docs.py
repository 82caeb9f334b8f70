"""README.md and docs/*.md cannot drift from the code: every YAML config snippet validates, every Python snippet runs
(with the names it presumes supplied), every ``nemo-is`` command line parses against the CLI (the cheap ones run),
the diagnose example is the command's current output, and the demo's numbers are the committed run's summary."""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import types
from pathlib import Path

import click
import pytest
import typer.main
from omegaconf import OmegaConf
from typer.testing import CliRunner

from nemo_is_plugin.adapters.recipes import LOSS_KEYS, load_loss_spec
from nemo_is_plugin.apps.cli.main import app
from nemo_is_plugin.apps.demo.summary import BLOCKS, quoted

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
EXAMPLE = ROOT / "configs" / "examples" / "nemo_rl_grpo_tis.yaml"


def blocks(page: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M)


def _all(lang: str) -> list[tuple[str, int, str]]:
    return [(page, i, text) for page in PAGES for i, text in enumerate(blocks(page, lang))]


def _id(case) -> str:
    return f"{case[0]}#{case[1]}"


# ------------------------------------------------------------------ YAML
def _is_loss_config(text: str) -> bool:
    cfg = OmegaConf.create(text)
    section = cfg.get("loss_fn", cfg)
    return section is not None and set(map(str, section.keys())) <= LOSS_KEYS


@pytest.mark.parametrize("case", _all("yaml"), ids=_id)
def test_yaml_snippet_validates(case, tmp_path):
    page, _, text = case
    if not _is_loss_config(text):
        pytest.skip("not a loss_fn config")
    path = tmp_path / "snippet.yaml"
    path.write_text(text)
    assert load_loss_spec(path).name == "nemo_is.clipped_pg"


def test_there_are_yaml_snippets_in_the_readme_and_the_config_reference():
    assert blocks("README.md", "yaml") and blocks("docs/config.md", "yaml")


# ------------------------------------------------------------------ Python
def _nemo_rl_names(tmp_path: Path) -> dict:
    """The names the snippets presume: a master config, a NeMo-RL batch, grpo_train's train_data, verl's batch."""
    import torch

    from nemo_is_plugin.apps.cli.synthetic_batch import synthetic_batch

    logprobs, data = synthetic_batch(4, 16)
    master = OmegaConf.to_container(OmegaConf.load(EXAMPLE))
    (tmp_path / "grpo.yaml").write_text((ROOT / "configs" / "examples" / "nemo_rl_grpo_tis.yaml").read_text())
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    verl_batch = types.SimpleNamespace(
        batch={
            "old_log_probs": data["prev_logprobs"],
            "rollout_log_probs": data["generation_logprobs"],
            "response_mask": data["token_mask"],
            "advantages": data["advantages"],
            "token_level_scores": data["token_mask"],
        }
    )
    return {
        "master_config": master,
        "logprobs": logprobs,
        "n_seq": data["sample_mask"].sum(),
        "n_tok": mask.sum(),
        "batch": verl_batch,
        "train_data": collections.UserDict(data),
        "step": 0,
        "repeated_batch": {"total_reward": data["rewards"]},
        "self": types.SimpleNamespace(global_steps=0),
        "torch": torch,
        "_data": data,
        # grpo.setup's names around the one-line swap
        "loss_config": master["loss_fn"],
        "use_fused_linear_logprobs": False,
    }


def _readme_names(tmp_path: Path) -> dict:
    names = _nemo_rl_names(tmp_path)
    names["batch"] = names.pop("_data")  # README's `batch` is the loss's data mapping
    return names


def _diagnose_names(tmp_path: Path) -> dict:
    from nemo_is_plugin.apps.diagnose import synthetic_records, write_dump

    write_dump(synthetic_records(16, min_len=4, max_len=64, seed=0), tmp_path / "runs" / "demo" / "rollouts.jsonl")
    return {}


NAMES = {
    "README.md": _readme_names,
    "docs/nemo_rl.md": _nemo_rl_names,
    "docs/verl.md": _nemo_rl_names,
    "docs/diagnose.md": _diagnose_names,
}


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")])
def test_python_snippets_run(page, tmp_path, monkeypatch):
    """A page's Python blocks run in reading order, in one namespace (a later block uses an earlier import)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEMO_IS_DUMP_ROLLOUTS", str(tmp_path / "dump.jsonl"))
    namespace = NAMES.get(page, lambda _: {})(tmp_path)
    for i, text in enumerate(blocks(page, "python")):
        exec(compile(text, f"{page} (python block {i})", "exec"), namespace)  # noqa: S102 - the docs' own code
    if "metrics" in namespace:
        assert "loss" in namespace["metrics"]


# ------------------------------------------------------------------ command lines
def _command_lines() -> list[tuple[str, int, list[str]]]:
    """Every ``nemo-is ...`` line of a bash block, and every inline code span ``nemo-is ...`` of the text."""
    out = []
    for page in PAGES:
        for i, text in enumerate(blocks(page, "bash")):
            text = text.replace("\\\n", " ")
            for line in text.splitlines():
                line = line.split(" #", 1)[0].strip()
                if line.startswith("nemo-is "):
                    out.append((page, i, shlex.split(line)[1:]))
        for span in re.findall(r"`(nemo-is [^`]+)`", (ROOT / page).read_text()):
            out.append((page, -1, shlex.split(span)[1:]))
    return out


COMMANDS = _command_lines()


def test_the_docs_show_every_command():
    assert {args[0] for _, _, args in COMMANDS} >= {"validate", "demo", "diagnose", "bench", "evidence"}


@pytest.mark.parametrize("case", COMMANDS, ids=lambda c: f"{c[0]}:{' '.join(c[2])[:60]}")
def test_command_line_parses(case):
    _, _, args = case
    root = typer.main.get_command(app)
    if "--help" in args or "--version" in args:
        assert CliRunner().invoke(app, args).exit_code == 0
        return
    if len(args) == 1:  # the text names a command (`nemo-is diagnose`): it exists
        assert args[0] in root.commands
        return
    ctx = root.make_context("nemo-is", list(args), resilient_parsing=False)
    name, cmd, rest = root.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
    try:
        cmd.make_context(name, rest, parent=ctx)
    except click.UsageError as exc:  # an option the command no longer has, a bad value, ...
        pytest.fail(f"`nemo-is {' '.join(args)}`: {exc.format_message()}")


@pytest.mark.parametrize(
    "case",
    [c for c in COMMANDS if c[2][0] == "validate" and len(c[2]) > 1 and (ROOT / c[2][1]).is_file()],
    ids=lambda c: " ".join(c[2]),
)
def test_validate_command_runs(case, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, case[2])
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------ generated output quoted in the docs
def test_the_diagnose_example_is_the_current_output(tmp_path):
    from nemo_is_plugin.apps.diagnose import synthetic_records, write_dump

    (example,) = blocks("docs/diagnose.md", "text")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        write_dump(
            synthetic_records(128, min_len=16, max_len=4096, mismatch_std=0.02, steps=4, seed=7),
            "runs/synthetic/rollouts.jsonl",
        )
        result = CliRunner().invoke(
            app, ["diagnose", "runs/synthetic/rollouts.jsonl", "--no-plots"], env={"COLUMNS": "140"}
        )
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert result.output == example, "docs/diagnose.md's example drifted: regenerate it with the command it names"


SUMMARY = ROOT / "docs" / "demo_summary.json"


@pytest.mark.parametrize("page", sorted(BLOCKS))
def test_demo_numbers_are_the_committed_summary(page):
    summary = json.loads(SUMMARY.read_text())
    tag, render = BLOCKS[page]
    assert quoted((ROOT / page).read_text(), tag) == render(summary), (
        f"{page} does not quote docs/demo_summary.json: run python -m nemo_is_plugin.apps.demo.summary {SUMMARY}"
    )


def test_the_committed_summary_is_a_default_run():
    """The quoted numbers come from a full `nemo-is demo` (not --quick), with the figure of the same run."""
    summary = json.loads(SUMMARY.read_text())
    cfg = summary["config"]
    assert cfg["short"]["steps"] == 12 and cfg["long"]["response_length"] == 1024 and cfg["seed"] == 0
    assert set(summary["headline"]["settings"]) == {"gspo_exp_sum", "gspo_seq_mean", "token_tis", "ctpo"}
    assert summary["headline"]["long_response_length"] == 1024
