"""Per-step diagnostics of QUADS_SPEC section 7, computed from arrays, slash-namespaced.

With ``d_t = logp_rollout - logp_trainer`` over response tokens:

* ``mismatch/max_abs_logp_gap``, ``mismatch/mean_abs_logp_gap``, ``mismatch/p99_abs_logp_gap``
* ``mismatch/k3_kl`` = mean(rho - log rho - 1), rho = exp(-d_t); ``mismatch/k1`` = mean d_t
* ``mismatch/token_mult_prob_error`` = mean exp(|d_t|)
* ``is/weight_mean``, ``is/weight_max``, ``is/frac_truncated`` (token rho > C),
  ``is/frac_masked`` (tokens the IS mode removed), ``is/ess`` (normalised effective sample size)
* ``reward/mean``, ``reward/pass_rate``, ``rollout/response_len_mean``,
  ``rollout/truncation_rate``, ``rl/entropy``

Everything here is host-side numpy on one step's arrays: cheap next to a rollout, and exact.
"""

from __future__ import annotations

import numpy as np

from quads_jax.rl.grpo import GRPOConfig, is_weights


def _masked(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float64)[np.asarray(mask) > 0]


def mismatch_metrics(
    logp_rollout: np.ndarray, logp_trainer: np.ndarray, mask: np.ndarray
) -> dict[str, float]:
    """Rollout-vs-trainer log-prob gap statistics over response tokens (``[B, T]`` inputs)."""
    d = _masked(logp_rollout, mask) - _masked(logp_trainer, mask)
    if d.size == 0:
        nan = float("nan")
        keys = ("max_abs_logp_gap", "mean_abs_logp_gap", "p99_abs_logp_gap", "k3_kl", "k1",
                "token_mult_prob_error")
        return {f"mismatch/{k}": nan for k in keys}
    a = np.abs(d)
    # rho - log(rho) - 1 with rho = exp(-d): written via expm1 so tiny gaps keep their precision.
    k3 = np.expm1(-d) + d
    return {
        "mismatch/max_abs_logp_gap": float(a.max()),
        "mismatch/mean_abs_logp_gap": float(a.mean()),
        "mismatch/p99_abs_logp_gap": float(np.percentile(a, 99)),
        "mismatch/k3_kl": float(k3.mean()),
        "mismatch/k1": float(d.mean()),
        "mismatch/token_mult_prob_error": float(np.exp(np.minimum(a, 80.0)).mean()),
    }


def is_metrics(
    logp_old: np.ndarray, logp_rollout: np.ndarray, mask: np.ndarray, config: GRPOConfig
) -> dict[str, float]:
    """Statistics of the IS-correction weights that ``config.is_mode`` applies."""
    w, keep = is_weights(logp_old, logp_rollout, mask, config)
    w, keep = np.asarray(w, np.float64), np.asarray(keep, np.float64)
    m = np.asarray(mask) > 0
    n = int(m.sum())
    if n == 0:
        return {k: float("nan") for k in ("is/weight_mean", "is/weight_max", "is/frac_truncated",
                                         "is/frac_masked", "is/ess")}
    token_rho = np.exp(np.minimum(
        np.asarray(logp_old, np.float64) - np.asarray(logp_rollout, np.float64), 80.0))[m]
    wm = w[m]
    sum_w2 = float((wm**2).sum())
    return {
        "is/weight_mean": float(wm.mean()),
        "is/weight_max": float(wm.max()),
        "is/frac_truncated": float((token_rho > config.is_cap).mean()),
        "is/frac_masked": float(1.0 - keep[m].sum() / n),
        "is/ess": float(wm.sum() ** 2 / (n * sum_w2)) if sum_w2 > 0 else 0.0,
    }


def health_metrics(
    rewards: np.ndarray,
    correct: np.ndarray,
    mask: np.ndarray,
    truncated: np.ndarray,
    entropy: np.ndarray | None = None,
) -> dict[str, float]:
    """RL health: reward, pass rate, response length, truncation, entropy.

    Args:
      rewards: f32 ``[N]``; correct: bool ``[N]``; mask: ``[N, T]`` response mask;
      truncated: bool ``[N]`` (stopped by the length limit, not EOS);
      entropy: f32 ``[N, T]`` per-token entropy (trainer side), or None.
    """
    out = {
        "reward/mean": float(np.mean(rewards)),
        "reward/std": float(np.std(rewards)),
        "reward/pass_rate": float(np.mean(correct)),
        "rollout/response_len_mean": float(np.asarray(mask).sum(axis=1).mean()),
        "rollout/truncation_rate": float(np.mean(truncated)),
    }
    if entropy is not None:
        e = _masked(entropy, mask)
        out["rl/entropy"] = float(e.mean()) if e.size else float("nan")
    return out
