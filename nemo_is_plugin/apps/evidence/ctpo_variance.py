"""Experiment 2 (CTPO Props. 1-2; docs/evidence.md, 2): cumulative-token vs full-sequence IS ratio in policy gradients.

Synthetic policy with independent tokens: at every position t = 1..H the action a_t in {0..K-1} is drawn from the
behaviour policy mu; the learner is pi = softmax(theta_t) with its own logits per position (all equal to theta0), and
a fixed per-action advantage A(a). The per-token policy-gradient term at t estimates dJ/dtheta_t = m with
J = sum_t E_pi[A(a_t)], m = E_pi[A(a) (e_a - pi)] (computed by autograd on the closed form).

With r_j = pi(a_j) / mu(a_j) and f(a) = A(a) (e_a - pi) = A(a) grad log pi(a):

- cumulative (CTPO):   X_t = (prod_{j<=t} r_j) f(a_t)    <- autograd through the plugin's ``cumulative`` ratio
- full sequence:       Y_t = (prod_{j<=H} r_j) f(a_t)    <- the plugin's ``sequence`` IS weight exp(sum) (detached)
                                                            times the plugin's on-policy ``token`` ratio (value 1)

Both are unbiased for m. Y_t = X_t eps_t with eps_t = prod_{j>t} r_j independent of X_t, E[eps] = 1,
E[eps^2] = (1+d)^(H-t) with d = chi^2(pi || mu) = E_mu[r^2] - 1, so E|Y_t|^2 / E|X_t|^2 = (1+d)^(H-t) exactly
(Prop. 2 under independence) and the variance ratio is ((1+d)^(H-t) E|X_t|^2 - |m|^2) / (E|X_t|^2 - |m|^2).
Every moment is a finite sum over K actions, so the predictions are exact; the z-scores use empirical standard errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nemo_is_plugin.apps.evidence.stats import Z95
from nemo_is_plugin.loss.is_weights import finite_exp, is_log_weight
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.ratios import policy_log_ratio

CHI2_VALUES = (0.02, 0.05)  # per-token chi^2(pi || mu): (1+d)^31 = 1.85 and 4.54 at t = 1 for H = 32


@dataclass(frozen=True)
class SyntheticPolicy:
    """pi = softmax(logits) vs behaviour mu over K actions, identical and independent at every one of H positions.

    logits: Float64[K]; behaviour: Float64[K] (probabilities); advantage: Float64[K]; horizon: H.
    """

    logits: torch.Tensor
    behaviour: torch.Tensor
    advantage: torch.Tensor
    horizon: int

    @property
    def pi(self) -> torch.Tensor:
        return torch.softmax(self.logits, -1)

    @property
    def ratio(self) -> torch.Tensor:
        """r(a) = pi(a) / mu(a). Float64[K]."""
        return self.pi / self.behaviour

    @property
    def chi2(self) -> float:
        """d = chi^2(pi || mu) = E_mu[r^2] - 1, the same at every position."""
        return float((self.behaviour * self.ratio**2).sum() - 1)

    @property
    def r4(self) -> float:
        """E_mu[r^4], which sets the Monte Carlo error of second moments."""
        return float((self.behaviour * self.ratio**4).sum())

    def per_action_term(self) -> torch.Tensor:
        """f(a) = A(a) (e_a - pi) = A(a) grad_theta log pi(a). Float64[K actions, K components]."""
        k = self.logits.numel()
        return self.advantage[:, None] * (torch.eye(k, dtype=torch.float64, device=self.pi.device) - self.pi[None, :])

    def exact_gradient(self) -> torch.Tensor:
        """m = d/dtheta E_pi[A(a)] by autograd on the closed form (independent of the estimators). Float64[K]."""
        theta = self.logits.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad((torch.softmax(theta, -1) * self.advantage).sum(), theta)
        return grad

    def mu_moment(self, power: int, direction: torch.Tensor | None = None) -> float:
        """E_mu[r^power |f|^power] (or with f projected on ``direction``: E_mu[r^power (f.u)^power])."""
        f = self.per_action_term()
        size = f.norm(dim=-1) if direction is None else f @ direction
        return float((self.behaviour * self.ratio**power * size.abs() ** power).sum())


def make_policy(
    *, num_actions: int = 8, chi2: float = 0.05, horizon: int = 32, seed: int = 0, advantage_offset: float = 1.0
) -> SyntheticPolicy:
    """A random behaviour mu and a learner tilted away from it until chi^2(pi || mu) = ``chi2`` (bisection).

    The advantage is ``advantage_offset`` + N(0, 0.5^2) per action: an un-baselined reward, so the squared exact
    gradient is small against the estimators' second moment and the variance ratio is close to (1+d)^(H-t).
    """
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.log_softmax(0.5 * torch.randn(num_actions, generator=g, dtype=torch.float64), -1)
    tilt = torch.randn(num_actions, generator=g, dtype=torch.float64)
    advantage = advantage_offset + 0.5 * torch.randn(num_actions, generator=g, dtype=torch.float64)

    def chi2_at(scale: float) -> float:
        pi = torch.softmax(log_mu + scale * tilt, -1)
        return float((pi**2 / log_mu.exp()).sum() - 1)

    lo, hi = 0.0, 1.0
    while chi2_at(hi) < chi2:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_at(mid) < chi2 else (lo, mid)
    return SyntheticPolicy(log_mu + hi * tilt, log_mu.exp(), advantage, horizon)


def estimator_gradients(
    policy: SyntheticPolicy, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample, per-token gradients of both estimators, by autograd through the plugin's ratio and IS weight.

    Each sample gets its own copy of the per-position logits, so the gradient of the summed surrogate with respect
    to copy [n, t] is the token-t term of sample n (the ratios push only the current token).

    Args:
        actions: Long[N, H] actions drawn from mu.
    Returns:
        (X, Y, cumulative weight): Float64[N, H, K] cumulative and full-sequence estimators, Float64[N, H] the
        value of the plugin's cumulative ratio prod_{j<=t} r_j.
    """
    n, h = actions.shape
    k = policy.logits.numel()
    layout = TokenLayout.padded(n, h, actions.device)
    mask = torch.ones(n, h, dtype=torch.float64, device=actions.device)
    gen = policy.behaviour.log()[actions]  # log mu(a_t): the "rollout" log-probs
    adv = policy.advantage[actions]
    theta = policy.logits.expand(n, h, k).clone().requires_grad_(True)
    curr = torch.log_softmax(theta, -1).gather(-1, actions[..., None]).squeeze(-1)  # log pi(a_t), [N, H]

    cum_ratio = torch.exp(policy_log_ratio("cumulative", curr, gen, mask, layout))
    (x,) = torch.autograd.grad((cum_ratio * adv).sum(), theta, retain_graph=True)

    full_w = finite_exp(is_log_weight("sequence", curr.detach(), gen, mask, layout))
    on_policy = torch.exp(policy_log_ratio("token", curr, curr.detach(), mask, layout))  # value 1, grad = score
    (y,) = torch.autograd.grad((full_w * on_policy * adv).sum(), theta)
    return x, y, cum_ratio.detach()


def predictions(policy: SyntheticPolicy, num_samples: int) -> dict[str, np.ndarray]:
    """Exact per-position predictions for t = 1..H.

    second_moment_ratio = (1+d)^(H-t); second_moment_ratio_se its unconditional Monte Carlo standard error for
    ``num_samples`` draws (delta method with exact population moments); variance_ratio exact, incl. the squared mean.
    """
    d, q, h = policy.chi2, policy.r4, policy.horizon
    t = np.arange(1, h + 1, dtype=np.float64)
    m = policy.exact_gradient()
    m2 = float(m @ m)
    b1 = (1 + d) ** (t - 1) * policy.mu_moment(2)  # E|X_t|^2
    b2 = q ** (t - 1) * policy.mu_moment(4)  # E|X_t|^4
    g2, g4 = (1 + d) ** (h - t), q ** (h - t)  # E[eps^2], E[eps^4]
    # Var(mean|Y|^2 / mean|X|^2) ~ G2^2 (B2 / B1^2) (G4 / G2^2 - 1) / N for Y = X eps, eps independent of X.
    ratio_se = g2 * np.sqrt(b2 / b1**2 * (g4 / g2**2 - 1) / num_samples)
    return {
        "t": t,
        "second_moment_ratio": g2,
        "second_moment_ratio_se": ratio_se,
        "variance_ratio": (g2 * b1 - m2) / (b1 - m2),
        "exact_gradient": m.numpy(),
    }


def simulate(
    policy: SyntheticPolicy,
    num_samples: int,
    *,
    seed: int = 0,
    chunk: int = 8192,
    progress: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Monte Carlo of both estimators over ``num_samples`` sequences drawn from mu, accumulated in chunks.

    Standard errors are empirical (from the same draws). The cumulative weight prod_{j<=t} r_j is heavy-tailed, so a
    rare extreme draw dominates the sample moments; an empirical (self-normalised) standard error grows with it and
    keeps z-scores calibrated, where the exact unconditional one (:func:`predictions`) would not.

    Returns, per t (and component k where shown): ``mean_*`` [H, K] and ``mean_se_*`` [H, K]; ``projection_*`` and
    ``projection_se_*`` [H] along the exact gradient's direction; ``second_moment_*`` [H]; ``variance_*`` [H]
    (covariance traces); ``second_moment_ratio`` [H] = mean|Y|^2 / mean|X|^2 with its delta-method
    ``second_moment_ratio_se``.
    """
    g = torch.Generator().manual_seed(seed)
    h, k = policy.horizon, policy.logits.numel()
    u = policy.exact_gradient()
    u = u / u.norm()
    # Running sums: x / y per component [H, K]; p* projections on u, a = |Y_t|^2, b = |X_t|^2 and products [H].
    acc = {name: torch.zeros(h, k, dtype=torch.float64) for name in ("x", "y", "xx", "yy")}
    per_t = ("px", "py", "pxx", "pyy", "a", "b", "aa", "bb", "ab")
    acc |= {name: torch.zeros(h, dtype=torch.float64) for name in per_t}
    done = 0
    while done < num_samples:
        n = min(chunk, num_samples - done)
        actions = torch.multinomial(policy.behaviour, n * h, replacement=True, generator=g).view(n, h)
        x, y, _ = estimator_gradients(policy, actions)
        a, b = (y * y).sum(-1), (x * x).sum(-1)  # |Y_t|^2, |X_t|^2: [n, H]
        px, py = x @ u, y @ u
        for name, v in (
            ("x", x),
            ("y", y),
            ("xx", x * x),
            ("yy", y * y),
            ("px", px),
            ("py", py),
            ("pxx", px * px),
            ("pyy", py * py),
            ("a", a),
            ("b", b),
            ("aa", a * a),
            ("bb", b * b),
            ("ab", a * b),
        ):
            acc[name] += v.sum(0)
        done += n
        if progress:
            progress(n)
    e = {name: (v / num_samples).numpy() for name, v in acc.items()}
    n = num_samples
    ratio = e["a"] / e["b"]
    # Delta method for a ratio of means: Var(abar / bbar) ~ E[(a - R b)^2] / (N E[b]^2).
    ratio_var = np.maximum(e["aa"] - 2 * ratio * e["ab"] + ratio**2 * e["bb"], 0.0) / (n * e["b"] ** 2)
    out = {"second_moment_ratio": ratio, "second_moment_ratio_se": np.sqrt(ratio_var)}
    for key, sfx in (("x", "cumulative"), ("y", "full")):
        out[f"mean_{sfx}"] = e[key]
        out[f"mean_se_{sfx}"] = np.sqrt((e[key * 2] - e[key] ** 2) / (n - 1))
        out[f"projection_{sfx}"] = e["p" + key]
        out[f"projection_se_{sfx}"] = np.sqrt((e["p" + key * 2] - e["p" + key] ** 2) / (n - 1))
        out[f"second_moment_{sfx}"] = e[key * 2].sum(-1)
        out[f"variance_{sfx}"] = n / (n - 1) * (e[key * 2] - e[key] ** 2).sum(-1)
    return out


def _z(diff: np.ndarray, se: np.ndarray) -> np.ndarray:
    """diff / se, with z = 0 where se = 0 (at t = H both estimators are the same product: no error at all)."""
    return np.divide(diff, se, out=np.zeros_like(diff), where=se > 0)


def analyse(policy: SyntheticPolicy, num_samples: int, *, seed: int = 0, progress=None) -> dict:
    """Simulate and compare with the exact predictions. Returns a JSON-ready dict (lists over t = 1..H)."""
    sim = simulate(policy, num_samples, seed=seed, progress=progress)
    pred = predictions(policy, num_samples)
    m = pred["exact_gradient"]
    z_cum = _z(sim["mean_cumulative"] - m, sim["mean_se_cumulative"])
    z_full = _z(sim["mean_full"] - m, sim["mean_se_full"])
    sm_z = _z(sim["second_moment_ratio"] - pred["second_moment_ratio"], sim["second_moment_ratio_se"])
    var_ratio = sim["variance_full"] / sim["variance_cumulative"]
    return {
        "chi2": policy.chi2,
        "horizon": policy.horizon,
        "num_actions": int(policy.logits.numel()),
        "num_samples": num_samples,
        "exact_gradient": m.tolist(),
        "squared_mean_fraction_t1": float(m @ m / policy.mu_moment(2)),
        "t": pred["t"].astype(int).tolist(),
        "predicted_second_moment_ratio": pred["second_moment_ratio"].tolist(),
        "predicted_second_moment_ratio_se": pred["second_moment_ratio_se"].tolist(),
        "predicted_variance_ratio": pred["variance_ratio"].tolist(),
        "measured_second_moment_ratio": sim["second_moment_ratio"].tolist(),
        "measured_second_moment_ratio_se": sim["second_moment_ratio_se"].tolist(),
        "measured_variance_ratio": var_ratio.tolist(),
        "second_moment_ratio_z": sm_z.tolist(),
        "variance_cumulative": sim["variance_cumulative"].tolist(),
        "variance_full": sim["variance_full"].tolist(),
        "projection_exact": float(np.linalg.norm(m)),
        "projection_cumulative": sim["projection_cumulative"].tolist(),
        "projection_cumulative_ci": (Z95 * sim["projection_se_cumulative"]).tolist(),
        "projection_full": sim["projection_full"].tolist(),
        "projection_full_ci": (Z95 * sim["projection_se_full"]).tolist(),
        "z_cumulative": z_cum.tolist(),
        "z_full": z_full.tolist(),
        "max_abs_z_cumulative": float(np.abs(z_cum).max()),
        "max_abs_z_full": float(np.abs(z_full).max()),
    }


def run_ctpo_variance(
    *,
    chi2_values: Sequence[float] = CHI2_VALUES,
    horizon: int = 32,
    num_actions: int = 8,
    num_samples: int = 400_000,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the experiment for each chi-square value. Returns ``{"runs": [analyse(...) per chi2]}``."""
    runs = []
    for i, d in enumerate(chi2_values):
        if progress:
            progress(f"CTPO variance: chi2={d:g}, H={horizon}, N={num_samples}")
        policy = make_policy(num_actions=num_actions, chi2=d, horizon=horizon, seed=seed + i)
        runs.append(analyse(policy, num_samples, seed=seed + 100 + i))
    return {"runs": runs}
