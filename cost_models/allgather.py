"""Formulas of the allgather algorithms (n bytes in all, blocks of b = n/p).

* ``ring``: p-1 steps, each a send and a receive of one block on the two
  links of a rank: T = (p-1) msg(b) = (p-1) alpha + (p-1)/p n beta.
* ``recursive_doubling``: log2 p' exchanges, step k moving the 2^k blocks
  of a group; with r = p - p' > 0 the ranks above p' first hand their block
  down (msg(b)) and get the whole buffer back at the end (msg(n)), and the
  group holding rank 0 also carries its folded ranks' blocks, min(2^k, r)
  of them: T = [r>0] msg(b) + sum_k msg((2^k + min(2^k, r)) b) + [r>0] msg(n).
  For p a power of two: log2 p alpha + (p-1)/p n beta (Thakur et al. 2005).
* ``bruck``: ceil(log2 p) steps, step k moving min(2^k, p - 2^k) blocks,
  any p: ceil(log2 p) alpha + (p-1)/p n beta, plus two local copies (into
  the rotated buffer and back): copy(b) + copy(n).

Every step but the fold and unfold is an exchange (a rank sends and
receives at once): ``xmsg`` in place of ``msg`` (see :mod:`.model`).
"""

from __future__ import annotations

from collectives.arithmetic import pow2_floor

from .model import Params, cost_model


@cost_model("allgather", "ring")
def ring(p: int, n: int, P: Params) -> float:
    """(p-1) xmsg(n/p): each step an exchange."""
    return (p - 1) * P.xmsg(n / p)


@cost_model("allgather", "recursive_doubling")
def recursive_doubling(p: int, n: int, P: Params) -> float:
    """[r>0] msg(b) + sum_k msg((2^k + min(2^k, r)) b) + [r>0] msg(n)."""
    if p == 1:
        return 0.0
    q = pow2_floor(p)
    r, b = p - q, n / p
    t = P.msg(b) if r else 0.0
    k = 1
    while k < q:
        t += P.xmsg((k + min(k, r)) * b)
        k <<= 1
    return t + (P.msg(n) if r else 0.0)


@cost_model("allgather", "bruck")
def bruck(p: int, n: int, P: Params) -> float:
    """sum_k msg(min(2^k, p - 2^k) b) + copy(b) + copy(n)."""
    if p == 1:
        return 0.0
    b, t, k = n / p, 0.0, 1
    while k < p:
        t += P.xmsg(min(k, p - k) * b)
        k <<= 1
    return t + P.copy(b) + P.copy(n)
