"""One rank of the MPI tests: every collective check over the mpi transport.

Run as ``mpiexec -n P python tests/mpi_rank_main.py OUTDIR [CHECK ...]``; each
rank writes ``OUTDIR/rank-N.json`` with its failures (files, because the
ranks' standard outputs interleave). Without CHECK names, every collective
check runs; ``message_order`` (not among them) checks the transport's own
message matching.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import collectives  # noqa: E402
from collectives import signature  # noqa: E402
from test_collectives import CHECKS  # noqa: E402

#: Sizes of one burst of messages with one tag: large ones (a header message and
#: a payload message each) between small ones (one message each).
BURST = [300_000, 100, 200_000, 0, 70_000, 65_536, 5, 65_537]


def _pattern(rank: int, index: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * (rank + 1) + index) % 251).astype(np.uint8)


def _burst(t, peer: int, tag: int, sig) -> list[str]:
    """Post every receive of a burst from ``peer``, then send one to it, then
    wait for the sends first: each rank then waits for a send that only the
    other's receive can complete."""
    recvs = [np.zeros(n, np.uint8) for n in BURST]
    rreqs = [t.irecv(buf, peer, tag, sig) for buf in recvs]
    sends = [_pattern(t.rank, i, n) for i, n in enumerate(BURST)]
    sreqs = [t.isend(buf, peer, tag, sig) for buf in sends]
    for req in sreqs + rreqs:
        req.wait(60)
    return [f"message {i} ({n} bytes) from rank {peer} (tag {tag}) arrived changed"
            for i, (n, got) in enumerate(zip(BURST, recvs)) if not np.array_equal(got, _pattern(peer, i, n))]


def check_message_order(comm) -> list[str]:
    """Messages of one tag meet their own receives, in order, however large."""
    peer = comm.rank ^ 1
    if peer >= comm.size:
        return []
    seq = 1 << 20  # far from the communicator's own calls
    sig = signature.with_seq(signature.make("allgather", "ring", None, None, np.dtype(np.uint8), 1), seq)
    return _burst(comm.transport, peer, 2 * 4242, signature.NO_SIG) + _burst(comm.transport, peer, 2 * seq + 1, sig)


ALL_CHECKS = {**CHECKS, "message_order": check_message_order}


def main() -> None:
    comm = collectives.init(transport="mpi", timeout=60)
    outdir, names = sys.argv[1], sys.argv[2:] or list(CHECKS)
    failures = []
    for name in names:
        failures += ALL_CHECKS[name](comm)
    with open(os.path.join(outdir, f"rank-{comm.rank}.json"), "w") as f:
        json.dump({"rank": comm.rank, "size": comm.size, "failures": failures}, f)
    comm.close()


if __name__ == "__main__":
    main()
