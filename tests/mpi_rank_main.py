"""One rank of the MPI tests: every collective check over the mpi transport.

Run as ``mpiexec -n P python tests/mpi_rank_main.py [CHECK ...]``; prints one
JSON line per rank with its failures.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import collectives  # noqa: E402
from test_collectives import CHECKS  # noqa: E402


def main() -> None:
    comm = collectives.init(transport="mpi", timeout=60)
    names = sys.argv[1:] or list(CHECKS)
    failures = []
    for name in names:
        failures += CHECKS[name](comm)
    print("RESULT " + json.dumps({"rank": comm.rank, "size": comm.size, "failures": failures}), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
