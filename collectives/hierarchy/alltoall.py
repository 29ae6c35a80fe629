"""``hierarchical`` alltoall and barrier.

alltoall on even hosts (L ranks each, blocks of b elements): an alltoall
within the host gives local rank s the blocks every local rank sends to
local rank s of every host; slot s then exchanges them with an alltoall
among its drivers (one chunk of L blocks per host), which leaves on each
rank exactly the blocks sent to it; copies put them in world order. Every
slot drives its share, (H-1) L b elements per rank cross hosts, as in the
flat algorithms, but in H-1 messages instead of (H-1) L.

On uneven hosts, one leader per host (local rank 0) gathers its host's
send buffers, exchanges each host's share with the other leaders pairwise
(chunks of L_i L_j blocks), and scatters what its ranks receive.

barrier: the check itself (every rank of a host arrives, then every host's
drivers hear from every other host's, and on uneven hosts driver 0 tells
the rest): nothing else is needed.
"""

from __future__ import annotations

import numpy as np

from .. import compiled
from . import agreement
from .table import SLICED, hierarchical

__all__ = ["alltoall", "barrier"]


@hierarchical("alltoall", SLICED, "alltoall within hosts, each slot's blocks alltoall across hosts "
              "(uneven hosts: through one leader per host)")
def alltoall(h, ctx, send: np.ndarray, recv: np.ndarray) -> None:
    agreement.check(h, ctx.sig, None)
    if h.topology.uneven:
        _through_leaders(h, send, recv)
    else:
        _by_slot(h, send, recv)


def _by_slot(h, send: np.ndarray, recv: np.ndarray) -> None:
    t = h.topology
    H, L, p = t.nhosts, t.local_size, h.size
    b = send.size // p
    blocks = send.reshape(p, b) if b else send.reshape(p, 0)
    # for local rank s: the blocks to local rank s of every host, host by host
    out = h.scratch("a2a.out", p * b, send.dtype).reshape(L, H, b)
    for s in range(L):
        for j in range(H):
            compiled.copy(out[s, j], blocks[t.hosts[j][s]])
    got = h.scratch("a2a.local", p * b, send.dtype).reshape(L, H, b)  # [from local i][to host j]
    h.host.alltoall(out.reshape(-1), got.reshape(-1))
    across = h.scratch("a2a.across", p * b, send.dtype).reshape(H, L, b)  # [to host j][from local i]
    np.copyto(across, got.transpose(1, 0, 2))
    back = h.scratch("a2a.back", p * b, send.dtype).reshape(H, L, b)  # [from host j][from its local i]
    if H > 1:
        cross = h.cross(t.group(t.local_rank))
        h.flat("alltoall", send.nbytes, H, send.itemsize)(cross, across.reshape(-1), back.reshape(-1))
    else:
        np.copyto(back, across)
    out_blocks = recv.reshape(p, b)
    for j, ranks in enumerate(t.hosts):
        for i, r in enumerate(ranks):
            compiled.copy(out_blocks[r], back[j, i])


def _through_leaders(h, send: np.ndarray, recv: np.ndarray) -> None:
    t = h.topology
    p, L = h.size, t.local_size
    b = send.size // p
    sizes = t.sizes
    lead = t.local_rank == 0
    gathered = h.scratch("a2a.gathered", L * p * b, send.dtype) if lead else None
    h.host.gatherv(send, gathered, [p * b] * L, 0)
    scattered = h.scratch("a2a.scattered", L * p * b, send.dtype) if lead else None
    if lead:
        _exchange_leaders(h, gathered.reshape(L, p, b), scattered.reshape(L, p, b), sizes, b)
    mine = h.scratch("a2a.mine", p * b, send.dtype)
    h.host.scatterv(scattered, mine, [p * b] * L, 0)
    # mine holds the blocks sent to this rank, host by host, each host's in local order
    at = 0
    out_blocks = recv.reshape(p, b)
    for ranks in t.hosts:
        for r in ranks:
            compiled.copy(out_blocks[r], mine[at * b:(at + 1) * b])
            at += 1


def _exchange_leaders(h, gathered: np.ndarray, scattered: np.ndarray, sizes: tuple[int, ...], b: int) -> None:
    """Pairwise among the leaders: to host j, the blocks every local rank sends to j's ranks."""
    t = h.topology
    H, me, L = t.nhosts, t.node, t.local_size
    dtype = gathered.dtype
    outgoing, incoming = [], []
    for j, ranks in enumerate(t.hosts):
        chunk = h.scratch(("a2a.to", j), L * sizes[j] * b, dtype).reshape(L, sizes[j], b)
        np.copyto(chunk, gathered[:, list(ranks), :])
        outgoing.append(chunk)
        incoming.append(h.scratch(("a2a.from", j), sizes[j] * L * b, dtype).reshape(sizes[j], L, b))
    np.copyto(incoming[me], outgoing[me])
    if H > 1:
        ctx = h.cross(t.group(0))
        for k in range(1, H):
            dst, src = (me + k) % H, (me - k) % H
            received = h.scratch(("a2a.raw", src), L * sizes[src] * b, dtype).reshape(sizes[src], L, b)
            ctx.sendrecv(outgoing[dst].reshape(-1), dst, received.reshape(-1), src)
            np.copyto(incoming[src], received)
    # incoming[j][i][k]: from local i of host j to local k here; scattered[k] lists them host by host
    offsets = np.cumsum([0] + list(sizes))
    for j in range(H):
        scattered[:, offsets[j]:offsets[j + 1], :] = incoming[j].transpose(1, 0, 2)


@hierarchical("barrier", SLICED, "the check: every rank of a host, then one round between hosts")
def barrier(h, ctx) -> None:
    agreement.check(h, ctx.sig, None)
