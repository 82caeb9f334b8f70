"""``nemo-is demo``: the end-to-end GRPO run (``--quick``) and the numerical checks of its two engines.

The quick run (~1.5 min on 2 cores) starts embedded Ray, a TP=2 Megatron policy over gloo and the fp8 rollout
engine, and runs the four loss settings of configs/demo side by side.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from nemo_is_plugin.apps.demo import task

STABLE = ("gspo_seq_mean", "token_tis", "ctpo")
SETTINGS = ("gspo_exp_sum", *STABLE)


# ---------------------------------------------------------------------------------------------- fast unit checks
def test_reward_is_exact_match_through_eos():
    prompts = torch.tensor([[task.BOS, 4, 5, 6, task.SEP]] * 4)
    good = [6, 5, 4, task.EOS]
    responses = torch.tensor(
        [
            good + [task.PAD],
            good + [7],  # text after the EOS is not graded (the long / ignore_eos setting)
            [6, 5, 4, 7, task.EOS],  # an extra digit before the EOS
            [6, 5, 4, task.PAD, task.PAD],  # never ended
        ]
    )
    assert task.rewards(prompts, responses).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_group_advantages_are_normalised_per_group():
    adv = task.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert adv[4:].tolist() == [0.0] * 4  # all equal -> no signal


def test_megatron_to_mixtral_splits_fused_qkv_and_gated_fc1():
    from nemo_is_plugin.apps.demo.model import ModelShape
    from nemo_is_plugin.apps.demo.vllm_backend import megatron_to_mixtral

    shape = ModelShape(layers=1, experts=2, hidden=8, heads=2, expert_ffn=4)
    hd = shape.head_dim
    # per head h: rows [q_h; k_h; v_h]; value = 100 * head + 10 * (0 q, 1 k, 2 v) + row
    qkv = torch.tensor(
        [[100 * h + 10 * j + r] * shape.hidden for h in range(2) for j in range(3) for r in range(hd)],
        dtype=torch.float32,
    )
    fc1 = torch.arange(8.0)[:, None].expand(8, shape.hidden)
    state = {
        "embedding.word_embeddings.weight": torch.zeros(16, 8),
        "decoder.final_layernorm.weight": torch.ones(8),
        "output_layer.weight": torch.zeros(16, 8),
    }
    pre = "decoder.layers.0."
    state.update(
        {
            pre + "self_attention.linear_qkv.weight": qkv,
            pre + "self_attention.linear_proj.weight": torch.eye(8),
            pre + "input_layernorm.weight": torch.ones(8),
            pre + "pre_mlp_layernorm.weight": torch.ones(8),
            pre + "mlp.router.weight": torch.zeros(2, 8),
        }
    )
    for e in range(2):
        state[pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
        state[pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = torch.zeros(8, 4)
    hf = megatron_to_mixtral(shape, state)
    k = hf["model.layers.0.self_attn.k_proj.weight"][:, 0].float().tolist()
    assert k == [10, 11, 12, 13, 110, 111, 112, 113]
    assert hf["model.layers.0.block_sparse_moe.experts.1.w1.weight"][:, 0].float().tolist() == [0, 1, 2, 3]  # gate
    assert hf["model.layers.0.block_sparse_moe.experts.1.w3.weight"][:, 0].float().tolist() == [4, 5, 6, 7]  # up


def test_unknown_loss_setting_is_a_clear_cli_error():
    from typer.testing import CliRunner

    from nemo_is_plugin.apps.cli.main import app

    result = CliRunner().invoke(app, ["demo", "--configs", "gspo_exp_sum,no_such_setting"])
    assert result.exit_code == 2
    assert "no_such_setting" in result.output and "gspo_seq_mean" in result.output


def test_cli_options_override_the_run_config(tmp_path):
    from nemo_is_plugin.apps.cli.demo import _build_config

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("grpo:\n  lr: 0.0005\nwarm_start:\n  steps: 7\n")
    cfg = _build_config("out", 3, 0, "token_tis, ctpo", None, "cpu", "bf16", 5, False, run_yaml)
    assert (cfg.short.steps, cfg.long, cfg.loss_settings, cfg.seed) == (3, None, ["token_tis", "ctpo"], 5)
    assert (cfg.grpo.lr, cfg.warm_start.steps, cfg.rollout.precision) == (5e-4, 7, "bf16")
    quick = _build_config("out", None, 2048, None, None, "cpu", None, 0, True, None)
    assert (quick.short.steps, quick.long.steps, quick.long.response_length) == (6, 1, 2048)
    assert quick.long.ignore_eos and quick.rollout.precision == "fp8"


# ---------------------------------------------------------------------------------------------- engine parity
def test_rollout_decoder_matches_megatron_in_fp32_and_differs_in_low_precision():
    from helpers.demo_parity import decoder_parity

    diff = decoder_parity(("fp32", "bf16", "fp8"))
    assert diff["fp32"] < 1e-4  # same function: the mismatch below is numerics only
    assert 1e-3 < diff["bf16"] < diff["fp8"] < 2.0


def test_megatron_moe_tp2_sequence_parallel_matches_tp1():
    from helpers.demo_parity import tp_parity

    diff = tp_parity()
    assert diff["logprob"] < 1e-5
    assert diff["grad_norm"] < 1e-5 * diff["grad_norm_value"] and diff["grad_norm_value"] > 0
    assert diff["weights"] == 0.0


# ---------------------------------------------------------------------------------------------- the quick run
@pytest.fixture(scope="module")
def quick_run(demo_quick_run) -> Path:
    return demo_quick_run


@pytest.fixture(scope="module")
def rows(quick_run) -> list[dict]:
    with open(quick_run / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_quick_run_writes_metrics_rollouts_and_plot(quick_run, rows):
    for name in ("metrics.jsonl", "metrics.csv", "rollouts.jsonl", "comparison.png", "summary.json"):
        assert (quick_run / name).stat().st_size > 0, name
    assert (quick_run / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    keys = {(r["config"], r["phase"], r["step"]) for r in rows}
    assert keys == {(c, "short", s) for c in SETTINGS for s in range(6)} | {(c, "long", 0) for c in SETTINGS}
    with open(quick_run / "metrics.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)


def test_every_logged_metric_is_finite(rows):
    required = (
        "reward",
        "response_length",
        "is_weight_mean",
        "is_raw_weight_std",
        "mismatch_kl_k3",
        "clip_fraction",
        "grad_norm",
        "loss",
    )
    for r in rows:
        for key in required:
            assert key in r, key
        for key, v in r.items():
            if key in ("config", "phase"):
                continue
            assert v is not None and math.isfinite(v), (r["config"], r["step"], key, v)


def test_stable_settings_raise_reward_above_warm_start(quick_run):
    summary = json.loads((quick_run / "summary.json").read_text())
    warm = summary["warm_start_reward"]
    assert 0.05 < warm < 0.8  # the warm start gives the policy a non-zero reward, with room to improve
    for name in STABLE:
        assert summary["final_reward"][name] > warm, (name, warm, summary["final_reward"])


def test_summary_headline_is_what_the_final_table_and_the_docs_show(quick_run, rows):
    from nemo_is_plugin.apps.demo.summary import demo_tables, readme_sentence

    summary = json.loads((quick_run / "summary.json").read_text())
    h = summary["headline"]
    for name in SETTINGS:
        own = [r["is_raw_weight_mean"] for r in rows if r["config"] == name and r["phase"] == "long"]
        assert h["settings"][name]["long_is_weight_mean"] == pytest.approx(sum(own) / len(own))
        assert h["settings"][name]["final_reward"] == summary["final_reward"][name]
    assert h["long_response_length"] == 1024 and h["long_responses"] == 16  # --quick: one shared long batch
    assert h["levels"]["sequence_mean"]["ess"] > 0.99
    assert "on 1024-token responses" in readme_sentence(summary) and "| final reward |" in demo_tables(summary)


def test_long_responses_collapse_exp_sum_weights_but_not_sequence_mean(rows):
    long_rows = {r["config"]: r for r in rows if r["phase"] == "long"}
    assert all(r["response_length"] == 1024 for r in long_rows.values())
    exp_sum, seq_mean = long_rows["gspo_exp_sum"], long_rows["gspo_seq_mean"]
    # The same 16 x 1024 tokens, two IS levels: exp(sum) spreads over orders of magnitude, the geometric mean does not.
    assert exp_sum["is/sequence_far"] >= 0.25  # >= a quarter of the sequences weighted < 1/2 or > 2
    assert exp_sum["is_raw_weight_ess"] < 0.85
    assert exp_sum["is_raw_weight_min"] < 0.2 or exp_sum["is_raw_weight_max"] > 5.0
    assert abs(seq_mean["is_raw_weight_mean"] - 1.0) < 0.02 and seq_mean["is_raw_weight_std"] < 0.02
    assert seq_mean["is/sequence_mean_far"] == 0.0


def test_rollout_dump_is_what_diagnose_reads(quick_run):
    from nemo_is_plugin.apps.diagnose.readers import read_dump

    with open(quick_run / "rollouts.jsonl") as fh:
        recs = [json.loads(line) for line in fh]
    assert len(recs) == 4 * 6 * 128 + 4 * 16
    assert [r["sample_id"] for r in recs] == list(range(len(recs)))
    gaps = []
    for r in recs:
        n = len(r["generation_logprobs"])
        assert n == len(r["prev_logprobs"]) == len(r["mask"]) > 0
        assert set(r["mask"]) <= {0, 1} and r["reward"] in (0.0, 1.0)
        assert max(r["generation_logprobs"]) <= 0.0 and max(r["prev_logprobs"]) <= 1e-6
        gaps.extend(abs(p - g) for p, g, m in zip(r["prev_logprobs"], r["generation_logprobs"], r["mask"]) if m)
    assert 1e-5 < sum(gaps) / len(gaps) < 0.1  # a real but small engine mismatch
    assert {r["config"] for r in recs} == {*SETTINGS, *(f"{c}@long" for c in SETTINGS)}
    dump = read_dump(quick_run)
    assert dump.num_responses == len(recs) and dump.config[-1] == recs[-1]["config"]


@pytest.mark.skipif(
    not (torch.cuda.is_available() and __import__("importlib").util.find_spec("vllm")), reason="needs vllm + CUDA"
)
def test_vllm_backend_generates_with_logprobs(tmp_path):
    from nemo_is_plugin.apps.demo.model import ModelShape
    from nemo_is_plugin.apps.demo.vllm_backend import VLLMBackend

    shape = ModelShape(max_seq_len=128)
    state = {k: torch.randn(v) * 0.05 for k, v in _random_state_shapes(shape).items()}
    backend = VLLMBackend(shape, precision="bf16", temperature=1.0, seed=0)
    backend.load_weights(state)
    out = backend.generate(task.make_prompts(4, 4, torch.Generator().manual_seed(0)), 8, ignore_eos=True, seed=0)
    assert out.tokens.shape == (4, 8) and bool((out.logprobs <= 0).all()) and int(out.mask.sum()) == 32


def _random_state_shapes(shape) -> dict[str, tuple[int, ...]]:
    h, f = shape.hidden, shape.expert_ffn
    out = {
        "embedding.word_embeddings.weight": (shape.vocab_size, h),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (shape.vocab_size, h),
    }
    for i in range(shape.layers):
        pre = f"decoder.layers.{i}."
        out.update(
            {
                pre + "self_attention.linear_qkv.weight": (3 * h, h),
                pre + "self_attention.linear_proj.weight": (h, h),
                pre + "input_layernorm.weight": (h,),
                pre + "pre_mlp_layernorm.weight": (h,),
                pre + "mlp.router.weight": (shape.experts, h),
            }
        )
        for e in range(shape.experts):
            out[pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
            out[pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
    return out
