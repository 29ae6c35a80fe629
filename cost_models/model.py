"""The alpha-beta-gamma model: parameters, the formula table and shared terms.

A formula ``T(p, n, P)`` gives the predicted seconds of one algorithm for
``p`` ranks and ``n`` bytes (the whole buffer, or for scatter, gather,
allgather, reduce_scatter and alltoall the p blocks together) under
parameters ``P`` (:class:`Params`, resolved for one dtype). Formulas
register with :func:`cost_model` under (collective, name), the key of the
algorithm they describe. The terms (after Thakur, Rabenseifner and Gropp
2005; Chan et al. 2007): a message ``P.msg(m) = alpha + overhead + m beta``,
an exchange step ``P.xmsg(m)``, reductions ``m gamma``, local copies, fences,
a per-call cost, the stretch of ranks that outnumber the cores, and the
anchors a calibrated profile measured; docs/cost-models.md gives each.
A long message travels in pieces of ``segment_bytes``; a stream reduced as
it lands costs :func:`stream`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from collectives.context import SEGMENT_BYTES

__all__ = ["Params", "CostModel", "MODELS", "cost_model", "predict", "lg", "nsegments",
           "segment_sizes", "stream", "even_blocks", "send_sum", "split_terms"]


@dataclass(frozen=True)
class Params:
    """Parameters of the cost model (seconds, bytes).

    Attributes:
        alpha: latency of one message.
        beta: seconds per byte of a message.
        gamma: seconds per byte reduced, for dtypes not in ``gamma_by_dtype``.
        gamma_by_dtype: seconds per byte reduced, by dtype name (``"float32"``).
        mem_bandwidth: bytes per second of a local copy (np.copyto).
        fence: seconds of one shared-window fence.
        segment_bytes: pipeline segment size of the algorithms.
        itemsize: element size in bytes (set by :meth:`for_dtype`).
        protocol: optional piecewise (alpha, beta): tuples
            ``(up_to_bytes, alpha, beta)`` in increasing size; messages above
            the last bound use ``alpha`` and ``beta``.
        overhead: CPU seconds per message around the transport's own latency.
        exchange: per-byte cost of an exchange step (a rank sends and
            receives at once) over that of a one-way message (see :meth:`xmsg`).
        call: seconds of one collective call's fixed work (checks, choice, plan).
        cores: cores the ranks share on one host (0: every rank has its own).
        cma_from: bytes from which one cross-memory read beats the window's
            two copies, as the shared-memory transport raced them at
            calibration (a job's selector takes its own race's; picks the
            window's direct compiled calls, see ``tuning.COMPILED_DIRECT``).
        stretch: measured ``(p, message-latency factor, message-byte factor,
            fence factor, local factor)`` in increasing p (see
            :meth:`stretch_at`); when given, it replaces the ``p / cores``
            stretch.
        anchors: measured ``(collective, algorithm, p, bytes, seconds)`` of
            algorithms at their smallest size, and at a large one (see
            :func:`predict`).
        source: where the numbers come from (a profile path or "defaults").
    """

    alpha: float = 5e-6
    beta: float = 1.0 / 4e9
    gamma: float = 1.0 / 2e9
    gamma_by_dtype: dict[str, float] = field(default_factory=dict, compare=False)
    mem_bandwidth: float = 8e9
    fence: float = 2e-6
    segment_bytes: int = SEGMENT_BYTES
    itemsize: int = 8
    protocol: tuple[tuple[int, float, float], ...] = ()
    overhead: float = 0.0
    exchange: float = 1.0
    call: float = 0.0
    cores: int = 0
    cma_from: int = 0
    stretch: tuple[tuple[int, float, float, float, float], ...] = ()
    anchors: tuple[tuple[str, str, int, int, float], ...] = ()
    source: str = "defaults"

    def for_dtype(self, dtype: Any) -> "Params":
        """These parameters with ``gamma`` and ``itemsize`` of ``dtype``."""
        dt = np.dtype(dtype)
        gamma = self.gamma_by_dtype.get(dt.name, self.gamma)
        if gamma == self.gamma and dt.itemsize == self.itemsize:
            return self
        return replace(self, gamma=gamma, itemsize=dt.itemsize)

    def stretch_at(self, p: int) -> tuple[float, float, float, float]:
        """(message latency, message bytes, fence, local work) stretch factors
        at ``p`` ranks: measured ones, linear between measured rank counts, 1
        below the first, and growing as ``p`` beyond the last."""
        table = self.stretch
        if not table or p < table[0][0]:
            return 1.0, 1.0, 1.0, 1.0
        for lo, hi in zip(table, table[1:]):
            if lo[0] <= p <= hi[0]:
                w = (p - lo[0]) / (hi[0] - lo[0]) if hi[0] > lo[0] else 0.0
                return tuple(a + w * (b - a) for a, b in zip(lo[1:], hi[1:]))  # type: ignore[return-value]
        last = table[-1]
        return tuple(f * p / last[0] for f in last[1:])  # type: ignore[return-value]

    def messages(self) -> str:
        """What a message costs, by size piece (the fit's pieces: a transport may
        change protocol, and the last piece's intercept alone says little about
        small messages): "17.04 us + 0.111 ns/B (9.01 GB/s)" per piece."""
        from collectives.arithmetic import show_bytes

        pieces = [*self.protocol, (None, self.alpha, self.beta)]
        parts = []
        for up, alpha, beta in pieces:
            where = f"up to {show_bytes(up)}: " if up is not None else ("above: " if len(pieces) > 1 else "")
            bw = f"{1e-9 / beta:.2f} GB/s" if beta else "no limit"
            parts.append(f"{where}{alpha * 1e6:.2f} us + {beta * 1e9:.4f} ns/B ({bw})")
        return "; ".join(parts)

    def latency_only(self) -> "Params":
        """These parameters with every per-byte cost zero (the latency terms of a formula)."""
        return replace(self, beta=0.0, gamma=0.0, gamma_by_dtype={}, mem_bandwidth=math.inf,
                       protocol=tuple((bound, a, 0.0) for bound, a, _ in self.protocol), stretch=())

    def local_only(self) -> "Params":
        """These parameters with every cost but local copies and reductions
        zero (the local terms of a formula)."""
        return replace(self, alpha=0.0, beta=0.0, overhead=0.0, call=0.0, fence=0.0, stretch=(),
                       protocol=tuple((bound, 0.0, 0.0) for bound, _, _ in self.protocol))

    def fence_only(self) -> "Params":
        """These parameters with every cost but the fence zero (the fence terms of a formula)."""
        return replace(self.latency_only(), alpha=0.0, overhead=0.0, call=0.0,
                       protocol=tuple((bound, 0.0, 0.0) for bound, _, _ in self.protocol))

    def msg(self, m: float) -> float:
        """Seconds of one message of ``m`` bytes."""
        return self._line(m, 1.0)

    def xmsg(self, m: float) -> float:
        """Seconds of one exchange step: ``m`` bytes out and ``m`` bytes in at once."""
        return self._line(m, self.exchange)

    def _line(self, m: float, per_byte: float) -> float:
        """``alpha + overhead + m beta per_byte`` with the (alpha, beta) of
        ``m``'s size range, never below what the ranges before it cost at
        their upper ends (a fit of each range apart may start a range lower
        than the last one ended; a larger message never costs less)."""
        floor = 0.0
        for bound, a, b in self.protocol:
            if m <= bound:
                return max(a + m * b * per_byte, floor) + self.overhead
            floor = max(floor, a + bound * b * per_byte)
        return max(self.alpha + m * self.beta * per_byte, floor) + self.overhead

    def copy(self, m: float) -> float:
        """Seconds of a local copy of ``m`` bytes."""
        return m / self.mem_bandwidth if self.mem_bandwidth > 0 and math.isfinite(self.mem_bandwidth) else 0.0

    @property
    def segment(self) -> int:
        """Bytes of one pipeline piece (whole elements, at least one)."""
        return max(1, self.segment_bytes // self.itemsize) * self.itemsize

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (see :mod:`collectives.cost_models.calibrate`)."""
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma,
                "gamma_by_dtype": dict(self.gamma_by_dtype), "mem_bandwidth": self.mem_bandwidth,
                "fence": self.fence, "segment_bytes": self.segment_bytes, "overhead": self.overhead,
                "exchange": self.exchange,
                "call": self.call, "cores": self.cores, "cma_from": self.cma_from,
                "stretch": [list(t) for t in self.stretch],
                "anchors": [list(t) for t in self.anchors],
                "protocol": [list(t) for t in self.protocol], "source": self.source}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Params":
        """Inverse of :meth:`as_dict` (unknown keys ignored)."""
        known = {k: d[k] for k in ("alpha", "beta", "gamma", "mem_bandwidth", "fence", "segment_bytes",
                                   "overhead", "exchange", "call", "cores", "cma_from", "source") if k in d}
        return cls(**known, gamma_by_dtype=dict(d.get("gamma_by_dtype", {})),
                   protocol=tuple(tuple(t) for t in d.get("protocol", ())),
                   stretch=tuple(_stretch_row(t) for t in d.get("stretch", ()) if len(t) in (4, 5)),
                   anchors=tuple((str(t[0]), str(t[1]), int(t[2]), int(t[3]), float(t[4]))
                                 for t in d.get("anchors", ()) if len(t) == 5))


@dataclass(frozen=True)
class CostModel:
    """A registered formula.

    Attributes:
        collective, name: the algorithm it describes.
        func: ``func(p, n, P) -> seconds``.
        summary: first line of its docstring.
        call: whether a call also costs :attr:`Params.call` (the message
            path's fixed work, which calibration fits on message
            algorithms); False for a compiled call's (the shared window's).
    """

    collective: str
    name: str
    func: Callable[[int, int, Params], float]
    summary: str
    call: bool = True

    def fixed(self, P: Params) -> float:
        """Seconds of the call's fixed work added to the formula."""
        return P.call if self.call else 0.0


MODELS: dict[tuple[str, str], CostModel] = {}


def cost_model(collective: str, name: str, call: bool = True) -> Callable:
    """Decorator: register ``func(p, n, P)`` as the formula of (collective,
    name); ``call`` False: its calls do not cost :attr:`Params.call` (see
    :class:`CostModel`)."""
    def deco(func: Callable[[int, int, Params], float]) -> Callable:
        summary = (func.__doc__ or "").strip().split("\n")[0]
        MODELS[(collective, name)] = CostModel(collective, name, func, summary, call)
        return func
    return deco


def predict(collective: str, name: str, p: int, nbytes: int, params: Params | None = None,
            dtype: Any = np.float32) -> float:
    """Predicted seconds of algorithm ``name`` of ``collective``.

    Args:
        collective, name: the algorithm.
        p: number of ranks.
        nbytes: message size (the selector's convention).
        params: model parameters (default: :class:`Params` defaults).
        dtype: element type (sets gamma and the element size).

    Returns:
        Seconds; for p == 1 only the call's fixed work.
    """
    from . import _load

    _load()
    model = MODELS[(collective, name)]
    P = (params or Params()).for_dtype(dtype)
    nbytes = int(nbytes) - int(nbytes) % P.itemsize
    points = _anchor_index(P.anchors).get((collective, name, int(p))) if P.anchors else None
    if not points:
        return _formula(model, int(p), nbytes, P)
    at, seconds = points[0]
    if len(points) == 1 or nbytes <= at:
        return seconds + _formula(model, int(p), nbytes, P) - _formula(model, int(p), at, P)
    i = max(j for j in range(len(points) - 1) if points[j][0] <= nbytes) if nbytes < points[-1][0] \
        else len(points) - 2
    (lo, t_lo), (hi, t_hi) = points[i], points[i + 1]
    f_lo, f_hi, f_n = (_formula(model, int(p), n, P) for n in (lo, hi, nbytes))
    if f_n < f_lo:  # the formula switches to a cheaper path: follow it in proportion
        return t_lo * f_n / f_lo
    if nbytes > hi and _switches(model, int(p), lo, hi, f_lo, f_hi, P):
        # beyond the last anchor, where the formula changes paths inside the
        # last interval: that interval's slope is the switch's, not a trend
        # to carry on; scale from the last anchor in proportion
        return t_hi * f_n / f_hi
    scale = (t_hi - t_lo) / (f_hi - f_lo) if f_hi > f_lo and t_hi > t_lo else 1.0
    return t_lo + scale * (f_n - f_lo)


def _switches(model: CostModel, p: int, lo: int, hi: int, f_lo: float, f_hi: float, P: Params) -> bool:
    """Whether the formula is far from a straight line between ``lo`` and
    ``hi`` bytes (it switches paths in between): its midpoint strays from the
    chord by more than a tenth of the rise."""
    mid = (lo + hi) // 2
    mid -= mid % P.itemsize
    return abs(_formula(model, p, mid, P) - (f_lo + f_hi) / 2) > 0.1 * abs(f_hi - f_lo)


def _formula(model: CostModel, p: int, nbytes: int, P: Params) -> float:
    """The formula with the fixed call cost and the sharing of cores."""
    seconds = float(model.func(p, nbytes, P)) + model.fixed(P)
    if P.stretch:
        terms = _terms(model, p, nbytes, P, seconds)
        return sum(f * t for f, t in zip(P.stretch_at(p), terms))
    return seconds * max(1.0, p / P.cores) if P.cores else seconds


@functools.lru_cache(maxsize=16)
def _anchor_index(anchors: tuple) -> dict[tuple[str, str, int], list[tuple[int, float]]]:
    """Each algorithm's measured points at each rank count, by size."""
    index: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for c, a, p, n, s in anchors:
        index.setdefault((c, a, p), []).append((n, s))
    for points in index.values():
        points.sort()
    return index


def _stretch_row(t: Any) -> tuple[int, float, float, float, float]:
    """A stretch table row; one of a profile without the local factor takes
    the message-byte factor for it."""
    factors = [float(x) for x in t[1:]]
    return (int(t[0]), *factors, *factors[1:2] * (4 - len(factors)))  # type: ignore[return-value]


def _terms(model: CostModel, p: int, nbytes: int, P: Params,
           total: float) -> tuple[float, float, float, float]:
    latency = float(model.func(p, nbytes, P.latency_only())) + model.fixed(P)
    fences = float(model.func(p, nbytes, P.fence_only()))
    local = float(model.func(p, nbytes, P.local_only()))
    return max(latency - fences, 0.0), max(total - latency - local, 0.0), fences, local


def split_terms(collective: str, name: str, p: int, nbytes: int, params: Params,
                dtype: Any = np.float32) -> tuple[float, float, float, float]:
    """(message latency, message bytes, fence, local copies and reductions)
    seconds of a prediction without stretch: what the :attr:`Params.stretch`
    factors multiply."""
    from . import _load

    _load()
    model = MODELS[(collective, name)]
    P = replace(params, stretch=(), cores=0).for_dtype(dtype)
    nbytes = int(nbytes) - int(nbytes) % P.itemsize
    total = float(model.func(int(p), nbytes, P)) + model.fixed(P)
    return _terms(model, int(p), nbytes, P, total)


# ------------------------------------------------------------ shared terms


def lg(p: int) -> int:
    """ceil(log2 p) (0 for p <= 1)."""
    return max(p - 1, 0).bit_length()


def even_blocks(n: int, parts: int, itemsize: int) -> list[int]:
    """Bytes of ``parts`` blocks that differ by at most one element (as the algorithms cut)."""
    q, r = divmod(n // itemsize, parts)
    return [(q + (1 if i < r else 0)) * itemsize for i in range(parts)]


def segment_sizes(n: int, P: Params) -> list[int]:
    """Bytes of the pieces a message of ``n`` bytes travels in (none for n == 0)."""
    seg = P.segment
    full, rest = divmod(n, seg)
    return [seg] * full + ([rest] if rest else [])


def nsegments(n: int, P: Params) -> int:
    """Number of pieces of an n-byte message."""
    return -(-n // P.segment)


def send_sum(n: int, P: Params, exchange: bool = False) -> float:
    """Seconds to send n bytes as back-to-back pieces over one link (while
    receiving as many, with ``exchange``)."""
    one = P.xmsg if exchange else P.msg
    return sum(one(m) for m in segment_sizes(n, P))


def stream(n: int, P: Params, reduce: bool = True, exchange: bool = False) -> float:
    """Seconds to receive n bytes in pieces and reduce each piece as it lands
    (while sending as many, with ``exchange``).

    Piece i arrives at ``A_i`` (the pieces' messages back to back) and its
    reduction starts when both it and the previous reduction are done; the
    stream ends with the last reduction: ``max_i (A_i + sum_{j >= i} m_j gamma)``.
    """
    sizes = segment_sizes(n, P)
    one = P.xmsg if exchange else P.msg
    if not reduce:
        return sum(one(m) for m in sizes)
    t_arrive, t_done = 0.0, 0.0
    for m in sizes:
        t_arrive += one(m)
        t_done = max(t_done, t_arrive) + m * P.gamma
    return t_done
