"""The least-squares fits of ``collectives calibrate``.

The measurements (:mod:`.calibration_measurements`) become model
parameters (:class:`~.model.Params`) here: the ping-pong sweep a line or a
few (:func:`fit_piecewise`), the exchange its factor (:func:`fit_exchange`),
the small collectives ``overhead`` and ``call`` (:func:`fit_overheads`),
the probes at each rank count the stretch factors (:func:`fit_stretch`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from .model import Params

__all__ = ["fit_line", "fit_piecewise", "fit_exchange", "fit_overheads", "fit_stretch"]


def fit_line(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``t = alpha + n beta`` weighted by 1/t.

    Returns:
        (alpha, beta, relative RMS error); alpha and beta clipped at 0.
    """
    n = np.asarray(sizes, float)
    t = np.asarray(times, float)
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    alpha, beta = max(float(alpha), 0.0), max(float(beta), 0.0)
    err = float(np.sqrt(np.mean(((alpha + beta * n - t) * w) ** 2)))
    return alpha, beta, err


def _fit_pieces(sizes: Sequence[float], times: Sequence[float], cuts: Sequence[int]) -> tuple[list, float]:
    """Lines fitted on the pieces ``sizes[cuts[i]:cuts[i+1]]``; (pieces, overall error)."""
    bounds = [0, *cuts, len(sizes)]
    pieces, sq = [], 0.0
    for lo, hi in zip(bounds, bounds[1:]):
        a, b, e = fit_line(sizes[lo:hi], times[lo:hi])
        pieces.append((int(sizes[hi - 1]), a, b))
        sq += e * e * (hi - lo)
    return pieces, math.sqrt(sq / len(sizes))


def fit_piecewise(sizes: Sequence[float], times: Sequence[float], max_pieces: int = 3,
                  min_points: int = 3) -> dict[str, Any]:
    """A line per size range: one more piece (split at measured sizes) each time
    it cuts the error by a tenth, up to ``max_pieces`` of at least ``min_points``.

    Returns:
        ``{"alpha", "beta", "protocol", "error"}``: the last piece's line, and
        the lower pieces as ``protocol`` ``[(up_to_bytes, alpha, beta), ...]``.
    """
    n = len(sizes)
    pieces, err = _fit_pieces(sizes, times, [])
    for count in range(2, max_pieces + 1):
        best = None
        for cuts in itertools.combinations(range(min_points, n - min_points + 1), count - 1):
            if any(b - a < min_points for a, b in zip(cuts, cuts[1:])):
                continue
            cand = _fit_pieces(sizes, times, cuts)
            if best is None or cand[1] < best[1]:
                best = cand
        if best is None or best[1] >= 0.9 * err:
            break
        pieces, err = best
    *lower, (_, alpha, beta) = pieces
    return {"alpha": alpha, "beta": beta, "protocol": lower, "error": err}


def fit_stretch(probes: Sequence[tuple[str, str, int, float]], params: Params,
                p: int) -> tuple[float, float, float, float]:
    """Least-squares ``(message latency, message bytes, fence, local)`` factors at ``p`` ranks.

    Each probe time is modelled as ``a L + b B + f F + c C`` with ``(L, B, F, C)``
    the terms of its unstretched prediction
    (:func:`~collectives.cost_models.model.split_terms`); residuals are
    relative, so that microsecond and millisecond probes weigh alike. A
    factor that comes out non-positive, or whose terms no probe has, is
    dropped and set to the mean of the others.
    """
    from .model import split_terms

    t = np.array([probe[3] for probe in probes], dtype=float)
    if not len(t) or p < 2:
        return 1.0, 1.0, 1.0, 1.0
    A = np.array([split_terms(c, a, p, n, params) for c, a, n, _ in probes], dtype=float) / t[:, None]
    y = np.ones_like(t)
    keep = [j for j in range(4) if A[:, j].any()]
    while keep:
        coef, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        bad = [j for j, c in zip(keep, coef) if c <= 0]
        if not bad:
            break
        keep.remove(bad[0])
    factors = dict(zip(keep, coef)) if keep else {}
    fill = float(np.mean(list(factors.values()))) if factors else 1.0
    return tuple(float(factors.get(j, fill)) for j in range(4))  # type: ignore[return-value]


def fit_overheads(probes: Sequence[tuple[str, str, int, float]], params: Params, p: int) -> tuple[float, float]:
    """Least-squares ``(overhead, call)`` from probe times (both clipped at 0).

    Each probe's residual ``t - predict(o=0, call=0)`` is modelled as
    ``call + k o`` with ``k`` the derivative of the prediction in ``o``.
    """
    from .model import predict

    if p < 2 or not probes:
        return 0.0, 0.0
    base = replace(params, overhead=0.0, call=0.0, cores=0)
    unit = replace(base, overhead=1e-6)
    rows, rhs = [], []
    for collective, algorithm, nbytes, t in probes:
        t0 = predict(collective, algorithm, p, nbytes, base)
        k = (predict(collective, algorithm, p, nbytes, unit) - t0) / 1e-6
        rows.append([1.0, k])
        rhs.append(t - t0)
    (call, overhead), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    if overhead < 0:
        overhead, call = 0.0, float(np.median(rhs))
    if call < 0:
        call = 0.0
        ks = np.array([r[1] for r in rows])
        overhead = max(float(np.dot(ks, rhs) / max(np.dot(ks, ks), 1e-30)), 0.0)
    return float(overhead), float(call)


def fit_exchange(sizes: Sequence[int], seconds: Sequence[float], params: Params) -> float:
    """The exchange factor (:attr:`~.model.Params.exchange`): the median over
    ``sizes`` of the measured exchange's per-byte time over a one-way
    message's, kept within [1, 4]."""
    ratios = [(t - params.msg(0)) / (params.msg(n) - params.msg(0))
              for n, t in zip(sizes, seconds) if params.msg(n) > params.msg(0)]
    return float(min(max(np.median(ratios), 1.0), 4.0)) if ratios else 1.0
