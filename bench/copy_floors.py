"""The host's floors for moving bytes between two processes:
``python -m collectives.bench.copy_floors``.

What no shared-memory collective of two ranks can beat on this host, so
that a collective's time can be read against it: a copy within one
process, a read of another process's buffer by cross-memory attach (one
copy, made by the kernel), two processes reading each other's at once
(alltoall's pattern), and a copy through shared memory and out again,
whole and in 64 KiB pieces (the window's bcast). A small C program
(``copy_floors.c``, built with the C compiler at run time) does the moves;
each figure is the median over ``--rounds`` rounds of the mean of
``--iters`` moves, in microseconds, with the bandwidth it implies.

    python -m collectives.bench.copy_floors                      # 512 KiB, 1 and 2 MiB
    python -m collectives.bench.copy_floors --sizes 64K,16M --rounds 9
    python -m collectives.bench.copy_floors --tcp --sizes 16M,32M   # the same over loopback TCP
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from .cli import parse_sizes

__all__ = ["main", "measure", "tcp_exchange"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copy_floors.c")
WAYS = ("memcpy", "cma_read", "cma_both", "two_copies", "pipelined")


def _build(folder: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the floors' program")
    exe = os.path.join(folder, "copy_floors")
    subprocess.run([cc, "-O2", SOURCE, "-o", exe], check=True, capture_output=True, timeout=120)
    return exe


def measure(sizes: Sequence[int], iters: int = 200, rounds: int = 5) -> dict[tuple[str, int], float]:
    """``{(way, bytes): microseconds}`` for every way of :data:`WAYS` and size."""
    got: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="copy_floors.") as folder:
        exe = _build(folder)
        for n in sizes:
            out = subprocess.run([exe, str(n), str(iters), str(rounds)], check=True, capture_output=True,
                                 text=True, timeout=600).stdout
            for line in out.splitlines():
                if line.startswith("FLOOR "):
                    _, way, nbytes, us = line.split()
                    got[(way, int(nbytes))] = float(us)
    return got


def tcp_exchange(nbytes: int, rounds: int = 9) -> float:
    """Milliseconds for two processes to send each other ``nbytes`` at once
    over one loopback TCP connection (a thread sends while the main one
    receives, plain ``sendall`` and ``recv_into``): the floor of a 2-rank
    exchange over TCP on this host. The median of ``rounds``."""
    import socket
    import threading

    import numpy as np

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        sock = socket.create_connection(("127.0.0.1", port))
    else:
        sock, _ = listener.accept()
    listener.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sender = threading.Thread(target=sock.sendall, args=(memoryview(src),))
        sender.start()
        view, got = memoryview(dst), 0
        while got < nbytes:
            got += sock.recv_into(view[got:])
        sender.join()
        times.append(time.perf_counter() - t0)
    sock.close()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.copy_floors", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512K,1M,2M")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tcp", action="store_true", help="instead: two processes exchanging the sizes over loopback TCP")
    ns = ap.parse_args(argv)
    sizes = parse_sizes(ns.sizes)
    if ns.tcp:
        print(f"# two processes, each sending the other the size at once over loopback TCP: the median of "
              f"{max(ns.rounds, 3)} rounds, ms (GB/s each way)")
        for n in sizes:
            ms = tcp_exchange(n, max(ns.rounds, 3))
            print(f"{n:>10d} {ms:>10.2f} ({n / ms / 1e6:.2f})")
        return 0
    try:
        got = measure(sizes, ns.iters, ns.rounds)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"copy_floors: {exc}", file=sys.stderr)
        return 1
    print(f"# two processes, the median of {ns.rounds} rounds' means of {ns.iters} moves: µs (GB/s)")
    print(f"{'bytes':>10s}" + "".join(f"{w:>20s}" for w in WAYS))
    for n in sizes:
        cells = [f"{got[(w, n)]:.1f} ({n / got[(w, n)] / 1e3:.1f})" if (w, n) in got else "" for w in WAYS]
        print(f"{n:>10d}" + "".join(f"{c:>20s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
