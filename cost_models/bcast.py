"""Formulas of the bcast algorithms (n bytes from the root to p ranks).

Notation: d = ceil(log2 p), s pieces of the segment size, ``msg(m)`` one
message, b_i the p nearly equal blocks (even_bounds) and p' = 2^floor(log2 p).

* ``binomial``: the root has d children and sends every piece to each, its
  outgoing link busy throughout; a child with d-1 children receives a piece
  every d messages and forwards it in d-1, so it never falls behind, and the
  deepest leaf gets the last piece when the root's last send ends:
  T = d (s alpha + n beta).
* ``pipelined_chain``: a flow shop of p-1 links over s pieces: the first
  piece crosses them one way, one after the other, then the others follow
  at the pace of a middle rank, which receives a piece while it sends the
  one before (an exchange): T = (p-1) msg(m_1) + sum_{k>1} xmsg(m_k); with
  p = 2 there is no middle rank: T = sum_k msg(m_k).
* ``scatter_ring_allgather`` (van de Geijn): binomial scatter, bounded by the
  root's sends: d alpha + (n - b_0) beta (Chan et al. 2007); ranks finish
  the scatter at different times, the last at that bound, and the ring
  that follows needs p-1 more exchange steps from it: T = T_scatter + (p-1) xmsg(b).
* ``scatter_recursive_doubling_allgather``: the same scatter, then log2 p'
  exchanges doubling the blocks held; for p not a power of two the ranks
  v >= p' hand their block to v - p' first (hidden behind the scatter) and
  get the whole buffer back at the end (one more msg(n)); the group of rank
  0 carries the most folded blocks: step k moves 2^k + min(2^k, r) blocks.
"""

from __future__ import annotations

from collectives.arithmetic import pow2_floor

from .model import Params, cost_model, even_blocks, lg, segment_sizes


def scatter_time(p: int, n: int, P: Params) -> float:
    """Binomial scatter of p blocks from the root: the root's sends, largest subtree first."""
    blocks = even_blocks(n, p, P.itemsize)
    d = lg(p)
    t, m = 0.0, 1 << (d - 1) if d else 0
    while m:
        if m < p:
            t += P.msg(sum(blocks[m:min(2 * m, p)]))
        m >>= 1
    return t


@cost_model("bcast", "binomial")
def binomial(p: int, n: int, P: Params) -> float:
    """d (s alpha + n beta): the root's link sends every piece d times."""
    return lg(p) * sum(P.msg(m) for m in segment_sizes(n, P))


@cost_model("bcast", "pipelined_chain")
def pipelined_chain(p: int, n: int, P: Params) -> float:
    """(p-1) msg(m_1) + sum_{k>1} xmsg(m_k): a pipeline through p-1 links."""
    if p == 1:
        return 0.0
    first, *rest = segment_sizes(n, P) or [0]
    if p == 2:
        return P.msg(first) + sum(P.msg(m) for m in rest)
    return (p - 1) * P.msg(first) + sum(P.xmsg(m) for m in rest)


@cost_model("bcast", "scatter_ring_allgather")
def scatter_ring_allgather(p: int, n: int, P: Params) -> float:
    """d alpha + (n - b_0) beta + (p-1) msg(b): scatter, then a ring allgather."""
    if p == 1:
        return 0.0
    return scatter_time(p, n, P) + (p - 1) * P.xmsg(max(even_blocks(n, p, P.itemsize)))


@cost_model("bcast", "scatter_recursive_doubling_allgather")
def scatter_recursive_doubling_allgather(p: int, n: int, P: Params) -> float:
    """scatter + sum_k msg((2^k + min(2^k, r)) b) + [r > 0] msg(n)."""
    if p == 1:
        return 0.0
    q = pow2_floor(p)
    r = p - q
    b = n / p
    t = scatter_time(p, n, P)
    k = 1
    while k < q:
        t += P.xmsg((k + min(k, r)) * b)
        k <<= 1
    return t + (P.msg(n) if r else 0.0)
