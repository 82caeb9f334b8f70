"""NeMoRLLossFn: NeMo-RL's LossFunction protocol around the plugin's loss (single process; the DP driver is in
functional_tests/test_nemo_rl_driver.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers.golden_utils import load_cases

from nemo_is_plugin.adapters.nemo_rl import PARALLEL_STATE, NeMoRLLossFn, build_nemo_rl_loss_fn
from nemo_is_plugin.adapters.nemo_rl.protocol import LossFunction, LossInputType, LossType, MetricNormalizer
from nemo_is_plugin.adapters.nemo_rl.step_metrics import for_nemo_rl_step, is_summed_extremum, micro_batch_mean_name
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.registry import UnknownLossError

CASES = {c["id"]: c for c in load_cases("nemo_rl") if "error" not in c["expected"]}
# token-level TIS, sequence-level loss + icepop, GSPO + IS, seq-mask-tis, NLL + rewards
PARITY = ["case_002", "case_011", "case_017", "case_005", "case_069"]

# Configurations whose metrics exercise every normaliser rule (names, counts, extrema).
SPLIT_CONFIGS = {
    "token_tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    },
    "gspo_nemo_rl": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "use_importance_sampling_correction": True,
    },
    "seq_mask_tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.05,
        "truncated_importance_sampling_ratio_min": 0.95,
    },
    "geo_rs_cumulative": {
        "truncated_importance_sampling_type": "geo-rs",
        "truncated_importance_sampling_ratio": 1.05,
        "truncated_importance_sampling_ratio_min": 0.95,
        "ratio_level": "cumulative",
        "loss_aggregation": "seq-mean-token-sum-norm",
        "token_level_loss": False,
        "loss_aggregation_norm": 8.0,
    },
    "rejection_rules_bypass": {
        "old_policy_logprobs": "generation",
        "importance_sampling_rejection_rules": [
            {"option": "token_k1", "threshold": "0.5_2.0"},
            {"option": "seq_max_k3", "threshold": 0.2},
            {"option": "seq_mean_k2", "threshold": 0.05},
        ],
    },
}


def _call(fn, case, x=None):
    data = dict(case["inputs"])
    nt = data.pop("next_token_logprobs")
    x = (nt if x is None else x).detach().clone().requires_grad_(True)
    loss, metrics = fn(
        next_token_logprobs=x,
        data=data,
        global_valid_seqs=case["global_valid_seqs"],
        global_valid_toks=case["global_valid_toks"],
    )
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("cid", PARITY)
def test_adapter_is_the_loss_and_reproduces_golden(cid):
    case = CASES[cid]
    fn = NeMoRLLossFn(case["config"])
    assert isinstance(fn, LossFunction)
    loss, grad, metrics = _call(fn, case)
    ref_loss, ref_grad, ref_metrics = _call(ClippedPGLoss(case["config"]), case)
    share = ref_metrics["num_valid_samples"] / float(case["global_valid_seqs"])
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert metrics == for_nemo_rl_step(ref_metrics, share)  # the plugin's extrema named for NeMo-RL's step
    torch.testing.assert_close(loss, case["expected"]["loss"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad, case["expected"]["grad_next_token_logprobs"], rtol=1e-4, atol=1e-6)


def test_protocol_attributes():
    tok = NeMoRLLossFn({"reference_policy_kl_penalty": 0.05})
    assert tok.loss_type == LossType.TOKEN_LEVEL and tok.input_type == LossInputType.LOGPROB
    assert tok.reference_policy_kl_penalty == 0.05 and tok.use_fused_linear_logprobs is False
    seq = NeMoRLLossFn({"token_level_loss": False, "use_kl_in_reward": True})
    assert seq.loss_type == LossType.SEQUENCE_LEVEL and seq.reference_policy_kl_penalty == 0.0
    for agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        assert NeMoRLLossFn({"loss_aggregation": agg}).loss_type == LossType.SEQUENCE_LEVEL
    assert NeMoRLLossFn({}, input_type=LossInputType.LOGIT).input_type == LossInputType.LOGIT
    with pytest.raises(ValueError):
        NeMoRLLossFn({}, input_type="distillation")
    with pytest.raises(ValueError, match="groups must be"):
        NeMoRLLossFn({}, groups="megatron")


def test_metric_normalizations_cover_every_metric_and_follow_the_rules():
    fn = NeMoRLLossFn(SPLIT_CONFIGS["seq_mask_tis"])
    norms = fn.metric_normalizations
    declared = fn.loss.metric_denominators()
    assert set(norms) == {micro_batch_mean_name(k) if is_summed_extremum(k) else k for k in declared}
    assert norms["is_oob_ratio"] == MetricNormalizer.SEQUENCES  # seq-mask-tis counts sequences
    assert norms["loss"] == norms["probs_ratio"] == MetricNormalizer.TOKENS
    # NeMo-RL's own extrema (grpo_train min / max-reduces them) are never rescaled; the plugin's, share-weighted
    # micro-batch means, are divided by the sequence count
    assert all(v == MetricNormalizer.NONE for k, v in norms.items() if k.endswith(("_min", "_max")))
    assert norms["is_weight/min_mb_mean"] == norms["is_weight/max_mb_mean"] == MetricNormalizer.SEQUENCES
    assert norms["num_valid_samples"] == norms["positive_nll_loss"] == MetricNormalizer.NONE
    gspo = NeMoRLLossFn(SPLIT_CONFIGS["gspo_nemo_rl"]).metric_normalizations
    assert gspo["loss"] == gspo["kl_penalty"] == gspo["sampling_importance_ratio"] == MetricNormalizer.SEQUENCES


def _batch(seed: int, b: int = 6, s: int = 9):
    g = torch.Generator().manual_seed(seed)
    lp = lambda: -torch.rand(b, s, generator=g) * 2 - 0.05  # noqa: E731
    tm = (torch.rand(b, s, generator=g) > 0.25).float()
    tm[:, 0] = 0
    tm[1] = 0  # an empty sequence
    data = {
        "token_mask": tm,
        "sample_mask": torch.tensor([1.0, 1, 1, 0, 1, 1])[:b],
        "advantages": torch.randn(b, s, generator=g),
        "prev_logprobs": lp(),
        "generation_logprobs": lp(),
        "reference_policy_logprobs": lp(),
        "rewards": torch.randn(b, generator=g),
    }
    return data, lp()[:, 1:]


@pytest.mark.parametrize("name", sorted(SPLIT_CONFIGS))
def test_split_api_rescale_equals_the_direct_call(name):
    """Micro-batches called with global counts of 1, rescaled by loss_type and metric_normalizations afterwards."""
    fn = NeMoRLLossFn(SPLIT_CONFIGS[name])
    data, x = _batch(1)
    sm = data["sample_mask"].double()
    n_seq, n_tok = float(sm.sum()), float((data["token_mask"][:, 1:] * sm[:, None]).sum())
    xd = x.clone().requires_grad_(True)
    loss, direct = fn(next_token_logprobs=xd, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok)
    loss.backward()
    _, core = fn.loss(next_token_logprobs=x, data=data, global_valid_seqs=n_seq, global_valid_toks=n_tok)
    direct_extrema = {k: v for k, v in core.items() if is_summed_extremum(k)}

    xs = x.clone().requires_grad_(True)
    raw_loss, raw, part_extrema = 0.0, [], []
    for lo, hi in ((0, 2), (2, 5), (5, 6)):
        part_data = {k: v[lo:hi] for k, v in data.items()}
        _, own = fn.loss(next_token_logprobs=x[lo:hi], data=part_data, global_valid_seqs=1.0, global_valid_toks=1.0)
        part_extrema.append({k: (v, float(sm[lo:hi].sum())) for k, v in own.items() if is_summed_extremum(k)})
        part, m = fn(
            next_token_logprobs=xs[lo:hi],
            data={k: v[lo:hi] for k, v in data.items()},
            global_valid_seqs=torch.tensor(1.0),
            global_valid_toks=torch.tensor(1.0),
        )
        part.backward()
        raw_loss += part.item()
        raw.append(m)
    n = n_tok if fn.loss_type == LossType.TOKEN_LEVEL else n_seq
    inv = {MetricNormalizer.TOKENS: 1 / n_tok, MetricNormalizer.SEQUENCES: 1 / n_seq, MetricNormalizer.NONE: 1.0}
    summed = {k: sum(m[k] for m in raw) for k in raw[0]}
    for k in summed:
        if k.endswith("_min"):
            summed[k] = min(m[k] for m in raw)
        elif k.endswith("_max"):
            summed[k] = max(m[k] for m in raw)
    rescaled = {k: v * inv[fn.metric_normalizations[k]] for k, v in summed.items()}
    assert raw_loss / n == pytest.approx(loss.item(), rel=1e-5, abs=1e-8)
    torch.testing.assert_close(xs.grad / n, xd.grad, rtol=1e-5, atol=1e-8)
    skip = {"sampling_importance_ratio"} if name == "gspo_nemo_rl" else set()  # NeMo-RL's broadcast bug: not additive
    # the plugin's extrema: not the batch's but each micro-batch's, weighted by its share of the valid sequences
    # (step_metrics); the direct call is one micro-batch, its share 1
    want = dict(direct)
    for name in {k for parts in part_extrema for k in parts}:
        assert direct[micro_batch_mean_name(name)] == direct_extrema[name]
        want[micro_batch_mean_name(name)] = sum(
            parts[name][0] * parts[name][1] / n_seq for parts in part_extrema if parts[name][1] > 0
        )
    bad = {
        k: (rescaled[k], want[k])
        for k in want
        if k not in skip and rescaled[k] != pytest.approx(want[k], rel=1e-6, abs=1e-12)
    }
    assert not bad
    assert any(v != 0 for k, v in direct.items() if fn.metric_normalizations[k] == MetricNormalizer.SEQUENCES)


def test_logit_input_matches_log_softmax_reference():
    g = torch.Generator().manual_seed(3)
    b, s, v = 3, 6, 11
    data, _ = _batch(2, b=b, s=s)
    data["sample_mask"] = torch.ones(b)
    data["input_ids"] = torch.randint(0, v, (b, s), generator=g)
    logits = torch.randn(b, s, v, generator=g, dtype=torch.float64)
    fn = NeMoRLLossFn({"use_importance_sampling_correction": True}, input_type="logit", groups=PARALLEL_STATE)
    lg = logits.clone().requires_grad_(True)
    loss, metrics = fn(logits=lg, data=data, global_valid_seqs=3.0, global_valid_toks=7.0)
    loss.backward()
    ref = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    ref_loss, ref_metrics = ClippedPGLoss(fn.config)(
        next_token_logprobs=lp, data=data, global_valid_seqs=3.0, global_valid_toks=7.0
    )
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(lg.grad.double(), ref.grad, rtol=1e-5, atol=1e-8)
    assert metrics["probs_ratio"] == pytest.approx(ref_metrics["probs_ratio"], rel=1e-6)
    # positional logits (NeMo-RL's DraftLossWrapper calls loss_fn(next_token_logits, data, gvs, gvt))
    again, _ = fn(logits, data, 3.0, 7.0)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def test_parallel_state_groups_are_read_at_every_call(monkeypatch):
    """groups=PARALLEL_STATE reads megatron-core's groups at each call: a process that rebuilds its groups (CP 2 -> 1)
    must not keep those of its first call."""
    case = CASES["case_002"]
    reads = []

    def from_parallel_state():
        reads.append(1)
        return ParallelGroups()

    monkeypatch.setattr(ParallelGroups, "from_parallel_state", staticmethod(from_parallel_state))
    fn = NeMoRLLossFn(case["config"], input_type="logit", groups=PARALLEL_STATE)
    data = dict(case["inputs"], input_ids=torch.zeros_like(case["inputs"]["token_mask"], dtype=torch.long))
    b, s = data["token_mask"].shape
    for _ in range(2):
        fn(logits=torch.zeros(b, s, 5), data=data, global_valid_seqs=b, global_valid_toks=float(s * b))
    assert len(reads) == 2


def test_pickles_for_ray_and_refuses_live_groups():
    case = CASES["case_002"]
    fn = NeMoRLLossFn(case["config"])
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.config == fn.config and clone.metric_normalizations == fn.metric_normalizations
    assert torch.equal(_call(clone, case)[0], _call(fn, case)[0])
    logit = pickle.loads(pickle.dumps(NeMoRLLossFn({}, input_type="logit", groups=PARALLEL_STATE)))
    assert logit.input_type == LossInputType.LOGIT and logit._groups_spec == PARALLEL_STATE
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(NeMoRLLossFn({}, input_type="logit", groups=ParallelGroups(tp=object())))


def test_missing_arguments_are_explained():
    fn = NeMoRLLossFn({})
    with pytest.raises(TypeError, match="needs data, global_valid_seqs and global_valid_toks"):
        fn(next_token_logprobs=torch.zeros(1, 1))
    with pytest.raises(TypeError, match="pass next_token_logprobs"):
        fn(data={}, global_valid_seqs=1, global_valid_toks=1)
    with pytest.raises(TypeError, match="pass logits"):
        NeMoRLLossFn({}, input_type="logit")(data={}, global_valid_seqs=1, global_valid_toks=1)


def test_build_nemo_rl_loss_fn_from_master_config_mapping_and_config(tmp_path):
    master = {"policy": {"x": 1}, "loss_fn": {"name": "nemo_is.clipped_pg", "ratio_clip_min": 0.1}}
    assert build_nemo_rl_loss_fn(master).config.ratio_clip_min == 0.1
    assert build_nemo_rl_loss_fn(master, ["loss_fn.ratio_clip_min=0.3"]).config.ratio_clip_min == 0.3
    assert build_nemo_rl_loss_fn(ClippedPGLossConfig(ratio_clip_max=0.4)).config.ratio_clip_max == 0.4
    with pytest.raises(ValueError, match="overrides apply to YAML"):
        build_nemo_rl_loss_fn(ClippedPGLossConfig(), ["loss_fn.ratio_clip_min=0.3"])
    with pytest.raises(UnknownLossError, match="Registered losses"):
        build_nemo_rl_loss_fn({"loss_fn": {"name": "nemo_is.nope"}})


def test_token_sum_is_refused_for_nemo_rl_and_its_loss_is_never_rescaled():
    """NeMo-RL's LossType cannot say 'divided by no count': the adapter refuses token-sum instead of letting the split
    API divide a sum; the normaliser of a token-sum loss is NONE."""
    from nemo_is_plugin.config import ConfigError

    with pytest.raises(ConfigError, match="token-sum' divides by no count"):
        NeMoRLLossFn({"loss_aggregation": "token-sum"})
    denominators = ClippedPGLoss({"loss_aggregation": "token-sum"}).metric_denominators()
    assert denominators["loss"] == denominators["kl_penalty"] == Denominator.NONE


def test_the_module_offers_only_the_adapters_builder():
    """Code written for the earlier adapter imported ``nemo_is_plugin.adapters.nemo_rl.build_loss_fn``; that name was
    the registry's builder, whose core loss NeMo-RL's workers cannot call. Only the adapter's own builder is here."""
    from nemo_is_plugin.adapters import nemo_rl

    assert not hasattr(nemo_rl, "build_loss_fn")
    with pytest.raises(ImportError):
        exec("from nemo_is_plugin.adapters.nemo_rl import build_loss_fn")  # noqa: S102
    assert isinstance(build_nemo_rl_loss_fn({"loss_fn": {}}), NeMoRLLossFn)
