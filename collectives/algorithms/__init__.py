"""The algorithms, one module per collective, registered by (collective, name).

Every algorithm is a plain function over point-to-point calls of a
:class:`~collectives.context.CallContext` (``ctx``). Arrays are 1-D,
C-contiguous numpy arrays of one dtype; counts are in elements. The
signatures, per collective:

==============  ==============================================================
bcast           ``f(ctx, buf, root)``; buf in place on every rank
scatter         ``f(ctx, sendbuf, recvbuf, root, counts)``; sendbuf (root only)
                is the concatenation of p blocks of ``counts[i]`` elements,
                recvbuf holds ``counts[rank]``
gather          ``f(ctx, sendbuf, recvbuf, root, counts)``; recvbuf on the root
                only (None elsewhere)
allgather       ``f(ctx, buf, counts)``; in place: buf is the concatenation of
                p blocks, this rank's block is already in place
reduce          ``f(ctx, buf, root, op)``; the result lands in buf on the root,
                other ranks' buf is left unchanged
allreduce       ``f(ctx, buf, op)``; in place on every rank
reduce_scatter  ``f(ctx, sendbuf, recvbuf, counts, op)``; sendbuf is the
                concatenation of p blocks (``counts``), unchanged; recvbuf
                (``counts[rank]``) receives the reduced block ``rank``
alltoall        ``f(ctx, sendbuf, recvbuf)``; p equal blocks each
barrier         ``f(ctx)``
==============  ==============================================================

``op`` is a :class:`~collectives.ops.Op`; ``avg`` arrives as a sum and the
communicator divides afterwards. Every algorithm works for any p >= 1,
any counts (zero included) and any root.
"""

from . import (  # noqa: F401  (importing registers the algorithms)
    allgather,
    allreduce,
    alltoall,
    barrier,
    bcast,
    gather,
    native,
    reduce,
    reduce_scatter,
    scatter,
    window,
)
