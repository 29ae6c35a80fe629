"""Formulas of the reduce_scatter algorithms (n bytes in all on every rank,
blocks of b = n/p; p' = 2^floor(log2 p), r = p - p').

* ``recursive_halving``: with r > 0 the first 2r ranks pair up and the odd
  one reduces its partner's n bytes as they stream in (stream(n)); then
  log2 p' halving steps over group ranks, the lowest of which stands for
  two blocks when r > 0: the step of mask m keeps m + min(m, r) blocks on
  group rank 0, the largest share: stream((m + min(m, r)) b) for
  m = p'/2, ..., 1; finally each absorbing rank returns its partner's block
  (msg(b)). For p a power of two: lg p alpha + (p-1)/p n (beta + gamma)
  (Thakur et al. 2005).
* ``ring``: p-1 ring steps, each msg(b) then b gamma of reduction (one
  piece per block): T = (p-1) (msg(b) + b gamma); with several pieces the
  steps overlap (see :func:`.allreduce.ring_time`).

The halving and ring steps are exchanges (``xmsg``, see :mod:`.model`).
"""

from __future__ import annotations

from .allreduce import ring_time
from collectives.arithmetic import pow2_floor

from .model import Params, cost_model, stream


@cost_model("reduce_scatter", "recursive_halving")
def recursive_halving(p: int, n: int, P: Params) -> float:
    """[r>0] stream(n) + sum_m stream((m + min(m, r)) b) + [r>0] msg(b)."""
    if p == 1:
        return P.copy(n)
    q = pow2_floor(p)
    r = p - q
    b = n / p
    t = stream(n, P) if r else 0.0
    m = q >> 1
    while m:
        t += stream(int(round((m + min(m, r)) * b)), P, exchange=True)
        m >>= 1
    return t + (P.msg(b) if r else 0.0)


@cost_model("reduce_scatter", "ring")
def ring(p: int, n: int, P: Params) -> float:
    """(p-1) (msg(b) + b gamma)."""
    return ring_time(p, n, P, allgather=False)
