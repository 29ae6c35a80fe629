"""Formulas of the allreduce algorithms (n bytes on every rank; p' = 2^floor(log2 p),
r = p - p', f = [r > 0]; ``stream(x)``: x bytes received in pieces and
reduced as they land, see :func:`.model.stream`).

* ``mst``: binomial reduce to rank 0 (see :mod:`.reduce`) then binomial
  bcast (see :mod:`.bcast`): T = T_reduce + d (s alpha + n beta).
* ``ring``: bucket algorithm (Chan et al. 2007): p-1 steps of ring
  reduce-scatter, each msg(b) then a reduction of b bytes (b = n/p), then
  p-1 steps of ring allgather, each msg(b): with one piece per block
  T = 2 (p-1) msg(b) + (p-1) b gamma. With several pieces per block the
  steps overlap; a rank's link sends every piece, so the link's time
  2 (p-1) sum_k msg(m_k) bounds it from below and the arithmetic
  (p-1) b gamma, when larger, replaces the reduce-scatter half.
* ``recursive_doubling``: f stream(n) to fold, log2 p' exchanges of the
  whole buffer, each stream(n), and f (s alpha + n beta) to unfold:
  T = (lg p' + f) stream(n) + f send(n)
  (about (lg p' + 2f)(alpha + n beta) + (lg p' + f) n gamma).
* ``rabenseifner``: fold, recursive halving (streams of n/2 ... n/p'),
  recursive-doubling allgather (log2 p' alpha + (p'-1)/p' n beta), unfold:
  T = f stream(n) + sum_k stream(n/2^k) + sum_k msg(2^k n/p') + f send(n)
  (about 2 lg p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma + f terms,
  Thakur et al. 2005).

The ring steps, the recursive-doubling and halving steps and the doubling
allgather are exchanges (``xmsg``, see :mod:`.model`); folds are one-way.
"""

from __future__ import annotations

from .bcast import binomial as bcast_binomial
from collectives.arithmetic import pow2_floor

from .model import Params, cost_model, even_blocks, lg, segment_sizes, send_sum, stream
from .reduce import binomial_reduce_time, halving_time


@cost_model("allreduce", "mst")
def mst(p: int, n: int, P: Params) -> float:
    """binomial reduce + binomial bcast."""
    return binomial_reduce_time(p, n, P) + bcast_binomial(p, n, P)


def ring_time(p: int, n: int, P: Params, allgather: bool) -> float:
    """The streaming ring reduce-scatter (+ allgather) of n bytes in p blocks."""
    if p == 1:
        return 0.0
    b = max(even_blocks(n, p, P.itemsize))
    sizes = segment_sizes(b, P)
    if len(sizes) <= 1:
        rs = (p - 1) * (P.xmsg(b) + b * P.gamma)
        return rs + ((p - 1) * P.xmsg(b) if allgather else 0.0)
    link = send_sum(b, P, exchange=True)
    m = sizes[0]
    rs = (p - 1) * max(link, b * P.gamma) + m * P.gamma + P.xmsg(m) - link / len(sizes)
    return rs + ((p - 1) * link if allgather else 0.0)


@cost_model("allreduce", "ring")
def ring(p: int, n: int, P: Params) -> float:
    """2 (p-1) msg(n/p) + (p-1) n/p gamma (one piece per block)."""
    return ring_time(p, n, P, allgather=True)


@cost_model("allreduce", "recursive_doubling")
def recursive_doubling(p: int, n: int, P: Params) -> float:
    """(lg p' + f) stream(n) + f send(n)."""
    if p == 1:
        return 0.0
    q = pow2_floor(p)
    f = 1 if p > q else 0
    return lg(q) * stream(n, P, exchange=True) + f * (stream(n, P) + send_sum(n, P))


@cost_model("allreduce", "rabenseifner")
def rabenseifner(p: int, n: int, P: Params) -> float:
    """f stream(n) + halving + doubling allgather + f send(n)."""
    if p == 1:
        return 0.0
    q = pow2_floor(p)
    f = 1 if p > q else 0
    t = f * stream(n, P) + halving_time(q, n, P)
    k = 1
    while k < q:
        t += P.xmsg(k * n / q)
        k <<= 1
    return t + f * send_sum(n, P)
