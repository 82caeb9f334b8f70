"""Monte Carlo bookkeeping shared by the evidence experiments: means with standard errors, z-scores, chi-square tests.

Everything here is plain statistics on samples the experiments produce with the plugin's functions; nothing here
computes a quantity the plugin computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Two-sided 95% normal quantile: confidence intervals are mean +- Z95 * se.
Z95 = 1.959963984540054


@dataclass(frozen=True)
class MeanEstimate:
    """Sample mean of i.i.d. draws with its standard error.

    mean, se: Float[*shape] (numpy, float64); n: number of draws.
    """

    mean: np.ndarray
    se: np.ndarray
    n: int

    def z(self, target: np.ndarray) -> np.ndarray:
        """(mean - target) / se, elementwise; the z-score of the hypothesis E[X] = target."""
        return (self.mean - np.asarray(target, dtype=np.float64)) / self.se

    def ci95(self) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) of the normal 95% confidence interval."""
        return self.mean - Z95 * self.se, self.mean + Z95 * self.se


def mean_estimate(samples: torch.Tensor) -> MeanEstimate:
    """Mean and standard error over the first dimension. samples: Float[N, *shape] -> MeanEstimate[*shape]."""
    x = samples.detach().double()
    n = x.shape[0]
    return MeanEstimate(mean=x.mean(0).cpu().numpy(), se=(x.std(0, unbiased=True) / math.sqrt(n)).cpu().numpy(), n=n)


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi^2_dof > stat), via the regularised upper incomplete gamma function (no scipy needed)."""
    a, x = (torch.tensor(v, dtype=torch.float64, device="cpu") for v in (dof / 2.0, stat / 2.0))  # host floats
    return float(torch.special.gammaincc(a, x))


def hotelling_test(samples: torch.Tensor, target: torch.Tensor) -> tuple[float, int, float]:
    """Large-sample Hotelling test of E[X] = target for vector draws.

    T^2 = N (xbar - target)^T S^+ (xbar - target) is chi-square with rank(S) degrees of freedom under the null.
    The pseudo-inverse handles singular covariances (softmax gradients sum to zero, so S has rank K - 1).

    Args:
        samples: Float[N, K] draws.
        target: Float[K] hypothesised mean.
    Returns:
        (T^2, degrees of freedom, p-value).
    """
    x = samples.detach().double()
    n = x.shape[0]
    diff = x.mean(0) - target.to(x.device, torch.float64)
    cov = torch.cov(x.T)
    # Relative tolerance well above float64 round-off: an exactly singular direction must not count as a dof.
    rank = int(torch.linalg.matrix_rank(cov, hermitian=True, rtol=1e-9))
    stat = float(n * diff @ torch.linalg.pinv(cov, hermitian=True, rtol=1e-9) @ diff)
    return stat, rank, chi2_sf(stat, rank)


def weight_summary(w: torch.Tensor) -> dict[str, float]:
    """Distribution of importance weights pooled over all given tokens.

    Returns mean (the effective learning-rate scale: the loss is linear in the weight), std, 5th / 50th / 95th
    percentiles, and the effective-sample-size fraction (sum w)^2 / (n sum w^2) in (0, 1].
    """
    arr = w.detach().double().reshape(-1).cpu().numpy()
    p5, p50, p95 = np.percentile(arr, [5.0, 50.0, 95.0])
    second = float(np.mean(arr * arr))
    mean = float(arr.mean())
    return {
        "mean": mean,
        "std": float(arr.std()),
        "p5": float(p5),
        "p50": float(p50),
        "p95": float(p95),
        "ess_fraction": mean * mean / second if second > 0 else 0.0,
    }
