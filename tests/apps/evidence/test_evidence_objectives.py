"""One measured property per policy objective (nemo_is_plugin/apps/evidence/objectives.py, objective_shapes.py): the
invariants each property must satisfy, on small synthetic batches at fixed seeds."""

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.evidence import objective_experiment as experiment
from nemo_is_plugin.apps.evidence import objective_shapes as shapes
from nemo_is_plugin.apps.evidence import objectives as obj

MASKING = ("ppo_clip", "dppo_tv", "dppo_kl", "prob_diff", "cppo")
# NeMo-RL's means divide by count + 1e-8: a count of n tokens or sequences reads n / (n + 1e-8), 1e-8 / n off.
MEAN_EPS = 1e-8


@pytest.fixture(scope="module")
def batch():
    return obj.make_batch(num_seqs=24, length=32, seed=3)


@pytest.fixture(scope="module")
def sweep(batch):
    return obj.run_drift_sweep(batch)


def test_batch_is_drawn_from_the_rollout_policy_and_drifts_from_pi_old(batch):
    assert batch.tokens.shape == (24, 32)
    # at drift 0 the current policy is pi_old itself; the drift grows the measured distance monotonically here
    torch.testing.assert_close(batch.token_logprobs(batch.logits(0.0)), batch.old_logprobs(), rtol=0, atol=0)
    dist = [obj.drift_summary(batch, s)["mean_abs_log_ratio"] for s in obj.DRIFTS]
    assert dist[0] == 0.0 and np.all(np.diff(dist) > 0)
    # the rollout log-probs are mu's, a small fixed mismatch from pi_old: close, not equal
    gap = (batch.rollout_logprobs - batch.old_logprobs()).abs()
    assert 0 < float(gap.mean()) < 0.1


@pytest.mark.parametrize("name", MASKING)
def test_dropped_fraction_grows_with_drift(sweep, name):
    """0 at drift 0 (r = 1 everywhere), non-decreasing along the sweep within 0.02 (about one binomial standard error
    of a fraction of 768 tokens: a token's probability need not move monotonically along the drift), engaged at the
    largest drift."""
    frac = np.array(sweep["objectives"][name]["clip_fraction"])
    assert frac[0] == 0.0
    assert np.all(np.diff(frac) > -0.02), frac
    assert frac[-1] > 0.1


def test_binary_tv_drops_a_subset_of_what_ppo_clips(sweep):
    """|p - q| = q |r - 1| <= |r - 1|: a token Binary-TV drops at 0.2 / 0.28 has r > 1.28 (A > 0) or r < 0.8 (A < 0),
    outside PPO's 0.2 band on the side its advantage pushes, so PPO's clip is active on it as well."""
    tv_cfg, ppo_cfg = obj.OBJECTIVE_CONFIGS["dppo_tv"], obj.OBJECTIVE_CONFIGS["ppo_clip"]
    assert (
        tv_cfg["dppo_delta_high"] >= ppo_cfg["ratio_clip_max"] and tv_cfg["dppo_delta_low"] >= ppo_cfg["ratio_clip_min"]
    )
    tv = np.array(sweep["objectives"]["dppo_tv"]["clip_fraction"])
    ppo = np.array(sweep["objectives"]["ppo_clip"]["clip_fraction"])
    assert np.all(tv <= ppo)
    assert np.any(tv > 0.05)


def test_every_objective_equals_the_untruncated_gradient_at_zero_drift(sweep):
    """At r = 1 no mask engages, SAPO's gate has slope 1, DRO's penalty has gradient 0, GPG's -A grad log pi is the
    policy gradient, and GMPO's seq-mean-token-mean equals the token mean (equal lengths, one advantage per sequence;
    up to its per-sequence count's + 1e-8)."""
    for name, row in sweep["objectives"].items():
        assert row["deviation"][0] < MEAN_EPS, name
        assert row["clip_fraction"][0] == 0.0, name


def test_the_masks_cost_gradient_once_engaged(sweep):
    """Once a mask drops tokens the batch gradient leaves the untruncated one; the soft / unmasked objectives never
    drop a token."""
    for name in MASKING:
        row = sweep["objectives"][name]
        engaged = np.array(row["clip_fraction"]) > 0.05
        assert np.all(np.array(row["deviation"])[engaged] > 0.01), name
    for name in ("sapo", "gpg", "dro (beta 0.5)", "dro (beta 2)"):
        assert max(sweep["objectives"][name]["clip_fraction"]) == 0.0


@pytest.mark.parametrize("name", sorted(obj.UNREACHABLE_THRESHOLDS))
@pytest.mark.parametrize("drift", (0.3, 1.0, 3.0))
def test_unreachable_thresholds_keep_every_token_and_give_the_untruncated_gradient(batch, name, drift):
    metrics, g = obj.loss_gradient(batch, drift, obj.UNREACHABLE_THRESHOLDS[name])
    _, g_pg = obj.loss_gradient(batch, drift, obj.UNTRUNCATED)
    assert metrics["clip_fraction"] == 0.0
    torch.testing.assert_close(g, g_pg, rtol=1e-10, atol=1e-14)


def test_gpg_ignores_the_anchor(batch):
    """GPG's -A log pi has no ratio: the gradient is the same whatever the old log-probs."""
    _, g = obj.loss_gradient(batch, 1.0, obj.OBJECTIVE_CONFIGS["gpg"])
    _, g_mu = obj.loss_gradient(batch, 1.0, obj.OBJECTIVE_CONFIGS["gpg"], anchor=batch.rollout_logprobs)
    torch.testing.assert_close(g, g_mu, rtol=0, atol=0)


def test_dro_pull_back_is_gpg_plus_beta_times_the_drift_gradient(batch, sweep):
    """DRO = GPG + beta/2 (log r)^2 (token mean), so its pull-back exceeds GPG's by exactly beta ||grad P||."""
    gpg = np.array(sweep["objectives"]["gpg"]["pull_back"])
    drift_norms = np.array([float(obj.drift_gradient(batch, s).norm()) for s in obj.DRIFTS])
    assert drift_norms[0] == 0.0
    for name, beta in (("dro (beta 0.5)", 0.5), ("dro (beta 2)", 2.0)):
        dro = np.array(sweep["objectives"][name]["pull_back"])
        np.testing.assert_allclose(dro - gpg, beta * drift_norms, rtol=1e-8, atol=1e-15)
        assert np.all(np.diff(dro) > 0)  # pulls back harder the further pi has drifted


def test_sapo_gate_weight(sweep):
    res = shapes.run_sapo_gate()
    r = np.array(res["ratios"])
    w = {k: {s: np.array(v) for s, v in d.items()} for k, d in res["weights"].items()}
    one = np.argmin(np.abs(r - 1.0))
    assert r[one] == 1.0
    # the gate's slope at r = 1 is the unclipped gradient weight 1, for both advantage signs
    assert w["sapo"]["pos"][one] == pytest.approx(1.0, abs=MEAN_EPS)
    assert w["sapo"]["neg"][one] == pytest.approx(1.0, abs=MEAN_EPS)
    np.testing.assert_allclose(w["unclipped"]["pos"], r, rtol=MEAN_EPS)
    # float64 reference: w = d/dlog r [sigmoid(tau (r - 1)) 4 / tau] = 4 sigma (1 - sigma) r
    for sign, tau in (("pos", 1.0), ("neg", 1.05)):
        sig = 1 / (1 + np.exp(-tau * (r - 1)))
        np.testing.assert_allclose(w["sapo"][sign], 4 * sig * (1 - sig) * r, rtol=MEAN_EPS)
    # PPO's hard clip: r inside the band, 0 past it on the side the advantage pushes (a grid point on a bound is
    # left out: exp(log 1.2) may round either side of it)
    off = (np.abs(r - 1.2) > 1e-9) & (np.abs(r - 0.8) > 1e-9)
    np.testing.assert_allclose(w["ppo_clip"]["pos"][off], np.where(r > 1.2, 0.0, r)[off], rtol=MEAN_EPS)
    np.testing.assert_allclose(w["ppo_clip"]["neg"][off], np.where(r < 0.8, 0.0, r)[off], rtol=MEAN_EPS)


def test_gmpo_without_clip_is_gspo_and_sequence_spread_falls_with_length():
    batch = obj.make_batch(num_seqs=16, length=48, seed=5)
    ratios = shapes.sequence_ratios(batch, 1.0, clip=1e9)
    torch.testing.assert_close(ratios["gmpo"], ratios["gspo"], rtol=1e-12, atol=0)
    res = shapes.run_gmpo_spread(num_seqs=64, lengths=(16, 256), seed=1)
    token, gspo = (np.array(res["ratios"][k]["std"]) for k in ("token", "gspo"))
    assert 0.8 < token[1] / token[0] < 1.25  # the token ratio does not average: its spread stays put
    assert 2.5 < gspo[0] / gspo[1] < 7  # a mean of L log-ratios: ~ sqrt(256 / 16) = 4 (64-sequence std estimates)
    # the sign-aware clip moves GMPO's ratio down for A > 0 and up for A < 0, relative to GSPO
    g = res["ratios"]
    assert np.all(np.array(g["gmpo"]["mean_pos"]) <= np.array(g["gspo"]["mean_pos"]))
    assert np.all(np.array(g["gmpo"]["mean_neg"]) >= np.array(g["gspo"]["mean_neg"]))


def test_cppo_budget_limit_and_lengths():
    res = shapes.run_cppo_budget(num_seqs=16, lengths=(16, 256), drifts=(0.3, 1.0), limit_length=48, seed=2)
    lim = res["limit"]
    bound, disagree = np.array(lim["budget_bound_fraction"]), np.array(lim["mask_disagreement"])
    # the loss's metric counts exactly the tokens where the mask differs from the per-token (delta_b = inf) mask
    np.testing.assert_allclose(bound, disagree, atol=1e-9)
    assert bound[0] > 0.1  # a tight budget drops tokens the per-token rule keeps
    assert np.all(np.diff(disagree) <= 0)  # a larger budget floor only ever keeps more
    at_least_one = np.array(lim["delta_b"]) >= 1.0
    assert at_least_one.any() and np.all(disagree[at_least_one] == 0.0)  # b W_k >= W_k >= S_k from delta_b = 1
    # at s = 1 the budget runs out in every sequence, early in the long ones and relatively later in the short ones
    rows = res["by_length"]["1"]
    assert rows["cppo_budget_exhausted_seq_fraction"] == pytest.approx([1.0, 1.0], rel=MEAN_EPS)
    pos = rows["cppo_budget_exhausted_position_fraction"]
    assert pos[0] > 2 * pos[1]


def test_headline_reads_the_sweep():
    res = experiment.run_objectives(num_seqs=8, length=16, lengths=(16, 32), seed=0)
    head = experiment.headline(res)
    assert set(head) == {"ppo_clip", "dppo_tv", "dppo_kl", "prob_diff", "cppo", "sapo", "gmpo", "gpg", "dro"}
    assert head["sapo"]["gate weight at r=1 (A>0)"] == pytest.approx(1.0, abs=MEAN_EPS)
    assert head["gpg"]["||g|| / ||g_pg|| at s=0"] == pytest.approx(1.0, rel=1e-12)
    i = res["drift_sweep"]["drifts"].index(experiment.HEADLINE_DRIFT)
    assert head["dppo_tv"]["dropped fraction at s=1"] == res["drift_sweep"]["objectives"]["dppo_tv"]["clip_fraction"][i]
