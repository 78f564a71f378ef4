"""Is the training loss flattered by repeated records?

Repeats make loss look better: a record the model saw a moment ago is cheap to predict. With
each consumed segment's training loss in the spool (the optional `loss` column), the job splits
the loss of exposures by their rank (1st, 2nd, ... exposure of the record) within windows of
steps. Within a window an exposure is *due* when its rank is at most what a perfect loader
allows by the window's first step, ceil(C_s / N), and *excess* when it is beyond what a
perfect loader allows by the window's last step; the few in between are left out. A correct
multi-epoch run has no excess exposures, so it is never compared with itself.

The test: the inverse-variance weighted mean, over windows from the first bad step on, of
(mean due loss - mean excess loss) per window, with its standard error; the loss is flattered
when that difference is at least three standard errors above zero (z >= 3, one-sided, p below
0.0015). Comparing within windows keeps training progress out of it: excess exposures come
later in a run, when every loss is lower.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Z_THRESHOLD = 3.0


def _mean_var(stats: np.ndarray) -> tuple[float, float, float]:
    """(count, mean, variance of the mean) from (count, sum, sum of squares)."""
    n, s, q = (float(x) for x in stats)
    if n < 2:
        return n, (s / n if n else float("nan")), float("inf")
    mean = s / n
    var = max(0.0, (q - s * s / n) / (n - 1))
    return n, mean, var / n


def split(loss_by_rank: np.ndarray, window: int, exposures_by_step: np.ndarray,
          n: int, first_step: int = 0) -> list[dict[str, Any]]:
    """Per window of steps from the run's first step: due and excess exposures' count and mean
    loss. `exposures_by_step` starts at `first_step`."""
    if not len(loss_by_rank) or not n:
        return []
    cum = np.cumsum(exposures_by_step)
    ranks = loss_by_rank.shape[1]
    out = []
    for w in range(len(loss_by_rank)):
        first, last = w * window, (w + 1) * window - 1
        if first >= len(cum):
            break
        allowed_first = -(-int(cum[first]) // n)
        allowed_last = -(-int(cum[min(last, len(cum) - 1)]) // n)
        # The cap's cell (ranks from the cap on) is due only when the cap itself is not.
        due = loss_by_rank[w, : min(allowed_first, ranks - 1)].sum(axis=0)
        # Ranks past the cap share its cell: excess only when the cap itself is beyond.
        excess = loss_by_rank[w, min(allowed_last, ranks):].sum(axis=0) \
            if allowed_last < ranks else np.zeros(3)
        out.append({"first_step": first_step + first, "last_step": first_step + last,
                    "due": _summary(due), "excess": _summary(excess),
                    "_due": due, "_excess": excess})
    return out


def _summary(stats: np.ndarray) -> dict[str, Any]:
    n, mean, _ = _mean_var(stats)
    return {"exposures": int(n), "mean_loss": None if not n else mean}


def test(windows: list[dict[str, Any]], since: int | None) -> dict[str, Any] | None:
    """The weighted difference (due - excess) and its z, over windows from step `since` on;
    None when no window holds both kinds."""
    if since is None:
        return None
    num = den = 0.0
    used, n_due, n_excess = 0, 0, 0
    for w in windows:
        if w["last_step"] < since:
            continue
        nd, md, vd = _mean_var(w["_due"])
        ne, me, ve = _mean_var(w["_excess"])
        if nd < 2 or ne < 2 or not np.isfinite(vd + ve) or vd + ve <= 0:
            continue
        weight = 1.0 / (vd + ve)
        num += weight * (md - me)
        den += weight
        used += 1
        n_due, n_excess = n_due + int(nd), n_excess + int(ne)
    if not den:
        return None
    diff, se = num / den, den ** -0.5
    return {"difference": diff, "standard_error": se, "z": diff / se, "windows": used,
            "due_exposures": n_due, "excess_exposures": n_excess, "since_step": since,
            "threshold_z": Z_THRESHOLD}


def gap(milestones: list[dict[str, Any]], since: int | None) -> dict[str, Any] | None:
    """How train and held-out loss moved between the first and the last milestone from step
    `since` on (None: fewer than two milestones with both). Context for the test, not part
    of it: a gap that widens within one run is also ordinary generalization."""
    if since is None:
        return None
    have = [m for m in milestones if m["step"] >= since and m.get("heldout_loss") is not None
            and m.get("train_loss") is not None]
    if len(have) < 2:
        return None
    a, b = have[0], have[-1]
    train = b["train_loss"] - a["train_loss"]
    held = b["heldout_loss"] - a["heldout_loss"]
    return {"from_step": a["step"], "to_step": b["step"], "train_change": train,
            "heldout_change": held, "widened_by": held - train}


def public(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in w.items() if not k.startswith("_")} for w in windows]
