"""Competing processes for ``collectives bench --background-load N[:KIND]``: a busy machine on demand.

KIND is one of:

* ``busy``: a tight CPU loop, never sleeping;
* ``bursty``: bursts of work with sleeps between, each burst and each sleep
  drawn at random around 2 ms on and 3 ms off (1-3 ms on, 2-4 ms off), so the
  scheduler keeps waking them and they keep preempting whoever runs.

:class:`BackgroundLoad` starts them (each its own ``python -m
collectives.bench.background KIND``) and stops them when its ``with`` block
ends, by any way: normally, on an exception, on Ctrl-C (SIGINT) or SIGTERM
(turned into an exception for the block's duration). Each process also
asks the kernel to kill it when the process that started it dies
(``PR_SET_PDEATHSIG``), so a bench killed with SIGKILL leaves none
behind. Each one's command line names its parent's pid, which is how a
test finds any left over.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["KINDS", "BackgroundLoad", "parse_load", "main"]

#: What each kind does (said in the bench's header).
KINDS = {"busy": "a tight CPU loop", "bursty": "bursts of work with sleeps between (1-3 ms on, 2-4 ms off, random)"}


def parse_load(spec: str | None) -> tuple[int, str]:
    """``"4"`` -> (4, "busy"); ``"2:bursty"`` -> (2, "bursty"); None or "0" -> (0, "busy")."""
    if not spec:
        return 0, "busy"
    count, _, kind = spec.partition(":")
    kind = kind or "busy"
    try:
        n = int(count)
    except ValueError:
        raise ValueError(f"--background-load {spec!r}: N[:KIND] with N a number") from None
    if n < 0 or kind not in KINDS:
        raise ValueError(f"--background-load {spec!r}: N >= 0, KIND one of {', '.join(KINDS)}")
    return n, kind


class _Stop(KeyboardInterrupt):
    """SIGTERM during a load's block: unwinds it like Ctrl-C."""


class BackgroundLoad:
    """``with BackgroundLoad(n, kind) as load:`` n competing processes exist inside the block
    (``load.pids``) and none after it. ``load.alive()``: how many still run."""

    def __init__(self, n: int, kind: str = "busy", seed: int | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown load kind {kind!r} (known: {', '.join(KINDS)})")
        self.n, self.kind, self.seed = n, kind, seed
        self.procs: list[subprocess.Popen] = []
        self._old_term: Any = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def describe(self) -> dict[str, Any]:
        return {"n": self.n, "kind": self.kind, "what": KINDS[self.kind], "pids": self.pids}

    def alive(self) -> int:
        return sum(1 for p in self.procs if p.poll() is None)

    def start(self) -> "BackgroundLoad":
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
        try:
            for i in range(self.n):
                seed = str(self.seed + i) if self.seed is not None else str(random.getrandbits(32))
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "collectives.bench.background", self.kind, "--parent", str(os.getpid()),
                     "--seed", seed],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every load process, wait for each (SIGKILL after ``grace`` seconds)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _on_term(self, signum: int, frame: Any) -> None:
        raise _Stop()

    def __enter__(self) -> "BackgroundLoad":
        if self.n and threading_main():
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None
        if exc[0] is _Stop:  # SIGTERM: die of it, as without the handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG: SIGKILL when the parent dies; and if it has already died, go now."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def _busy() -> None:
    x = 0
    while True:
        x += 1


def _bursty(rng: random.Random) -> None:
    clock, sleep = time.perf_counter, time.sleep
    while True:
        end = clock() + rng.uniform(0.001, 0.003)
        while clock() < end:
            pass
        sleep(rng.uniform(0.002, 0.004))


def main(argv: list[str] | None = None) -> int:
    """One load process: ``python -m collectives.bench.background busy|bursty --parent PID``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m collectives.bench.background")
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--parent", type=int, default=os.getppid())
    ap.add_argument("--seed", type=int, default=None)
    ns = ap.parse_args(argv)
    _die_with_parent(ns.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the bench's to handle
    if ns.kind == "busy":
        _busy()
    else:
        _bursty(random.Random(ns.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
