"""One rank of a multi-host test, run inside a network namespace.

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and COLLECTIVES_SECRET
(torchrun's variables), builds a ZeroMQ communicator, runs every check of
``test_collectives.CHECKS`` and prints one line ``RESULT <json>``: the
failures per check, the address this rank listened on and the seconds taken.
Exit status 0 when the checks ran (failures or not), 1 on an error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def until_cut(ready_file: str, heartbeat: float) -> int:
    """Allreduce in a loop until the job breaks (another host's link is cut);
    print ``RESULT`` with the error's type, message and wall-clock time."""
    import numpy as np

    import collectives

    comm = collectives.init(transport="zmq", timeout=60.0, zmq_heartbeat_timeout=heartbeat)
    buf = np.ones(1024, np.float32)
    try:
        comm.allreduce(buf)
        with open(f"{ready_file}.{comm.rank}", "w"):
            pass
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            buf[:] = 1
            comm.allreduce(buf, timeout=30.0)
        error = None
    except collectives.CollectiveError as exc:
        error = exc
    at = time.time()
    result = {"rank": comm.rank, "error": type(error).__name__ if error else None,
              "message": str(error), "at": at}
    print("RESULT " + json.dumps(result), flush=True)
    comm.close()
    return 0


def main() -> int:
    if os.environ.get("NETNS_READY_FILE"):
        return until_cut(os.environ["NETNS_READY_FILE"], float(os.environ.get("NETNS_HEARTBEAT", "2")))
    import collectives
    from test_collectives import CHECKS

    start = time.monotonic()
    comm = None
    try:
        comm = collectives.init(transport="zmq", timeout=float(os.environ.get("NETNS_COMM_TIMEOUT", "60")))
        failures = {name: check(comm) for name, check in CHECKS.items()}
        result = {"rank": comm.rank, "endpoint": comm.transport.endpoint, "failures": failures,
                  "seconds": round(time.monotonic() - start, 2)}
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    except BaseException as exc:
        if comm is not None:
            comm.abort(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    finally:
        if comm is not None:
            comm.close()


if __name__ == "__main__":
    sys.exit(main())
