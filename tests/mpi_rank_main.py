"""One rank of the MPI tests: every collective check over the mpi transport.

Run as ``mpiexec -n P python tests/mpi_rank_main.py OUTDIR [CHECK ...]``; each
rank writes ``OUTDIR/rank-N.json`` with its failures (files, because the
ranks' standard outputs interleave).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import collectives  # noqa: E402
from test_collectives import CHECKS  # noqa: E402


def main() -> None:
    comm = collectives.init(transport="mpi", timeout=60)
    outdir, names = sys.argv[1], sys.argv[2:] or list(CHECKS)
    failures = []
    for name in names:
        failures += CHECKS[name](comm)
    with open(os.path.join(outdir, f"rank-{comm.rank}.json"), "w") as f:
        json.dump({"rank": comm.rank, "size": comm.size, "failures": failures}, f)
    comm.close()


if __name__ == "__main__":
    main()
