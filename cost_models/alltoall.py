"""Formulas of the alltoall algorithms (n bytes per rank: p blocks of b = n/p).

* ``pairwise``: p-1 exchange steps of one block: T = (p-1) msg(b), plus
  the copy of the rank's own block.
* ``bruck``: ceil(log2 p) steps; step k sends the blocks whose index has bit
  k set (c_k of them, packed into one message): T = sum_k msg(c_k b), about
  ceil(log2 p) alpha + ceil(log2 p) n/2 beta (Bruck et al. 1997), plus two
  rotations of n bytes and the packing and unpacking of 2 c_k b per step.
"""

from __future__ import annotations

from .model import Params, cost_model


@cost_model("alltoall", "pairwise")
def pairwise(p: int, n: int, P: Params) -> float:
    """(p-1) xmsg(n/p) + copy(n/p): each step an exchange."""
    return (p - 1) * P.xmsg(n / p) + P.copy(n / p)


@cost_model("alltoall", "bruck")
def bruck(p: int, n: int, P: Params) -> float:
    """sum_k msg(c_k b) + copies (2 n + 2 sum_k c_k b)."""
    b, t, moved, k = n / p, 0.0, 0.0, 1
    while k < p:
        c = (p // (2 * k)) * k + max(0, p % (2 * k) - k)  # indices below p with bit k set
        t += P.xmsg(c * b)
        moved += c * b
        k <<= 1
    return t + P.copy(2 * n + 2 * moved)
