"""Every config snippet in the host docs loads, and equals the example recipe it is excerpted from; the custom
Megatron trainer's code runs as written (single process) and reproduces one direct call of the loss."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nemo_is_plugin.adapters.nemo_rl import build_nemo_rl_loss_fn
from nemo_is_plugin.adapters.recipes import load_loss_spec
from nemo_is_plugin.loss import ClippedPGLoss

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "configs" / "examples"
# doc page -> the example recipe its YAML snippet is taken from (None: the snippet is the recipe)
PAGES = {"nemo_rl.md": "nemo_rl_grpo_tis.yaml", "verl.md": "verl_ctpo_seqmean.yaml", "custom_megatron.md": None}
# where the plugin's keys sit in a page's snippet and example (verl's: the plugin section of verl's Hydra config)
SECTIONS = {"verl.md": "actor_rollout_ref.actor.policy_loss.nemo_is"}
# snippets that are no excerpt of the page's example but a config of their own: (page, index of the yaml block);
# nemo_rl.md opens with the one-line switch (`name: nemo_is.clipped_pg` and the keys it changes)
OWN_SNIPPETS = {("nemo_rl.md", 0)}


def _blocks(page: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_doc_yaml_snippet_loads_and_matches_its_example(page, tmp_path):
    blocks = _blocks(page, "yaml")
    assert blocks, f"{page} shows no YAML config snippet"
    for i, text in enumerate(blocks):
        path = tmp_path / f"snippet_{i}.yaml"
        path.write_text(text)
        section = SECTIONS.get(page, "loss_fn")
        spec = load_loss_spec(path, section=section)
        assert spec.name == "nemo_is.clipped_pg"
        if PAGES[page] is not None and (page, i) not in OWN_SNIPPETS:
            example = load_loss_spec(EXAMPLES / PAGES[page], section=section)
            assert spec.config == example.config, f"{page} drifted from its example"
    if page == "verl.md":  # the whole snippet is the example, verl's settings included
        from omegaconf import OmegaConf

        assert OmegaConf.create(blocks[0]) == OmegaConf.load(EXAMPLES / PAGES[page])


def test_nemo_rl_doc_one_line_build(tmp_path):
    text = _blocks("nemo_rl.md", "yaml")[0]
    path = tmp_path / "grpo.yaml"
    path.write_text(text)
    fn = build_nemo_rl_loss_fn(path, ["loss_fn.is_correction_level=sequence_mean"])
    assert fn.config.is_correction_level == "sequence_mean" and fn.config.truncated_importance_sampling_ratio == 2.0


def test_custom_megatron_code_runs_and_matches_one_direct_call(tmp_path):
    (code,) = _blocks("custom_megatron.md", "python")
    namespace: dict = {}
    exec(compile(code, "docs/custom_megatron.md", "exec"), namespace)  # noqa: S102 - the doc's own code
    recipe = tmp_path / "gspo.yaml"
    recipe.write_text(_blocks("custom_megatron.md", "yaml")[0])
    loss_fn = namespace["make_loss"](recipe)

    g = torch.Generator().manual_seed(5)
    b, s, v = 4, 7, 13
    lp = lambda: -torch.rand(b, s, generator=g) - 0.2  # noqa: E731
    tm = (torch.rand(b, s, generator=g) > 0.2).float()
    tm[:, 0] = 0
    data = {
        "input_ids": torch.randint(0, v, (b, s), generator=g),
        "token_mask": tm,
        "sample_mask": torch.ones(b),
        "advantages": torch.randn(b, 1, generator=g).expand(b, s).contiguous(),
        "prev_logprobs": lp(),
        "generation_logprobs": lp(),
    }
    logits = torch.randn(b, s, v, generator=g, requires_grad=True)
    micro = [{k: t[i : i + 2] for k, t in data.items()} | {"_rows": slice(i, i + 2)} for i in (0, 2)]
    forward = lambda mb: logits[mb["_rows"]]  # noqa: E731
    groups = namespace["ParallelGroups"]()
    metrics = namespace["train_step"](loss_fn, micro, forward, groups)

    x = torch.log_softmax(logits.detach()[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    n_tok = float((tm[:, 1:]).sum())
    loss, direct = ClippedPGLoss(loss_fn.loss.config)(
        next_token_logprobs=x, data=data, global_valid_seqs=float(b), global_valid_toks=n_tok
    )
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["sampling_importance_ratio"] == pytest.approx(direct["sampling_importance_ratio"], rel=1e-6)
    assert "is_weight_std" in metrics and "chi2_token" in metrics  # finalize_metrics ran
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_nemo_rl_doc_swap_keeps_nemo_rls_constructor(tmp_path):
    """The grpo.setup swap in docs/nemo_rl.md runs as written on NeMo-RL's config object (a pydantic model holding the
    example's loss_fn section, plugin keys as extras) and builds the loss the example recipe describes."""
    from adapters.nemo_rl_host import HostLossConfig
    from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
    from nemo_is_plugin.adapters.nemo_rl.protocol import LossInputType

    swap, master = _blocks("nemo_rl.md", "python")[:2]
    assert "NeMoRLLossFn(loss_config, use_fused_linear_logprobs=use_fused_linear_logprobs)" in swap
    section = dict(load_loss_spec(EXAMPLES / "nemo_rl_grpo_tis.yaml").config.model_dump(exclude_unset=True))
    for fused in (False, True):
        ns = {
            "NeMoRLLossFn": NeMoRLLossFn,
            "loss_config": HostLossConfig(**section),
            "use_fused_linear_logprobs": fused,
            "master_config": EXAMPLES / "nemo_rl_grpo_tis.yaml",
        }
        for block in (swap, master):
            exec(compile(block, "docs/nemo_rl.md", "exec"), ns)  # noqa: S102 - the doc's own code
            fn = ns.pop("loss_fn")
            assert fn.use_fused_linear_logprobs is fused and fn.input_type == LossInputType.LOGPROB
            assert fn.config == load_loss_spec(EXAMPLES / "nemo_rl_grpo_tis.yaml").config
