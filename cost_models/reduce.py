"""Formulas of the reduce algorithms (n bytes on every rank, result on the root).

* ``binomial``: a rank waits for the piece of every child, then reduces them
  all (``reduce_many``: one gamma per child) and sends the result up. With
  one piece, a subtree of k ranks has children of min(j, k-j) ranks
  (j = 1, 2, 4, ...); its root's incoming link takes their messages in the
  order they become ready: A = max(A, ready_c) + msg(n), and
  T(k) = A + children * n gamma, T(1) = 0. For p a power of two this is
  T = log2 p msg(n) + log2 p (log2 p + 1)/2 n gamma: every level's children
  are reduced at once, at the end (the classic lg p (alpha + n beta + n gamma)
  assumes a reduction after each message). With s pieces the levels
  overlap: T = T_1(m) + (s-1) d max(msg(m), m gamma), the root's link or its
  arithmetic being the bottleneck.
* ``rabenseifner``: fold p onto p' (r = p - p' > 0: a stream of n bytes
  reduced as it arrives), recursive halving (exchange-and-reduce of n/2,
  n/4, ..., n/p' as streams), a binomial gather of the p' blocks to the
  root (log2 p' alpha + (p'-1)/p' n beta), and when the root sat out the
  fold, one more msg(n) from the rank standing in for it (Rabenseifner 2004;
  Thakur et al. 2005: 2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma).
"""

from __future__ import annotations

from functools import lru_cache

from collectives.arithmetic import pow2_floor

from .model import Params, cost_model, lg, segment_sizes, stream


def _subtree_time(k: int, one_msg: float, one_reduce: float) -> float:
    @lru_cache(maxsize=None)
    def t(size: int) -> float:
        if size <= 1:
            return 0.0
        ready = sorted(t(min(j, size - j)) for j in (1 << i for i in range(lg(size))) if j < size)
        a = 0.0
        for rd in ready:
            a = max(a, rd) + one_msg
        return a + len(ready) * one_reduce
    return t(k)


def binomial_reduce_time(p: int, n: int, P: Params) -> float:
    """The binomial reduce of n bytes over p ranks (pieces pipelined)."""
    if p == 1 or n == 0:
        return 0.0
    sizes = segment_sizes(n, P)
    m = sizes[0]
    first = _subtree_time(p, P.msg(m), m * P.gamma)
    rest = sum(max(P.msg(x), x * P.gamma) for x in sizes[1:])
    return first + lg(p) * rest


@cost_model("reduce", "binomial")
def binomial(p: int, n: int, P: Params) -> float:
    """T(p) of the binomial tree, children reduced together; pieces pipelined."""
    return binomial_reduce_time(p, n, P)


def halving_time(p2: int, n: int, P: Params) -> float:
    """Recursive halving over p2 (a power of two) ranks: streams of n/2, ..., n/p2."""
    t, x = 0.0, n
    k = 1
    while k < p2:
        x = x / 2
        t += stream(int(round(x / P.itemsize)) * P.itemsize, P, exchange=True)
        k <<= 1
    return t


@cost_model("reduce", "rabenseifner")
def rabenseifner(p: int, n: int, P: Params) -> float:
    """fold + halving + binomial gather + [root folded out] msg(n)."""
    if p == 1:
        return 0.0
    q = pow2_floor(p)
    r = p - q
    t = stream(n, P) if r else 0.0
    t += halving_time(q, n, P)
    k = 1
    while k < q:
        t += P.msg(k * n / q)
        k <<= 1
    return t + (P.msg(n) if r else 0.0)  # the root (rank 0) sits out the fold when r > 0
