"""``collectives bench --background-load N[:KIND]``: the competing processes run through the
whole sweep and none is left after it, however the bench ends (normally, Ctrl-C, SIGKILL);
and the JAX comparison with mpi4jax (skipped without mpi4jax)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from collectives.bench.background import BackgroundLoad, parse_load

BENCH = [sys.executable, "-m", "collectives.bench"]
PIDS_LINE = "# background load: "


def _state(pid: int) -> str | None:
    """The process's state letter, or None when it is gone; a pid reused by another program is gone too."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"collectives.bench.background" not in f.read():
                return None
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    """Waits (a condition, with a deadline) until no pid runs; returns those still running."""
    end = time.monotonic() + deadline_s
    while True:
        left = [p for p in pids if _running(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


class _Bench:
    """The bench in a child process; threads drain its stdout and stderr, and ``pids(deadline)``
    waits until its stderr names the load's pids."""

    def __init__(self, args: list[str], cwd, sigint_ignored: bool = False) -> None:
        env = dict(os.environ, PYTHONFAULTHANDLER="1")  # SIGABRT prints every thread's stack (see wait)
        # SIGINT ignored from the start, as in a background job of a shell without job control
        first = ["bash", "-c", 'trap "" INT; exec "$@"', "bash"] if sigint_ignored else []
        self.proc = subprocess.Popen(first + BENCH + args, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self._pids: list[int] = []
        self._named = threading.Event()
        self._threads = [threading.Thread(target=self._drain, args=(self.proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._drain, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._threads:
            t.start()

    def _drain(self, stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            if line.startswith(PIDS_LINE) and "pids" in line:
                self._pids = [int(w) for w in line.split("pids", 1)[1].split()]
                self._named.set()
        self._named.set()  # the stream ended: nothing more will come

    def pids(self, deadline_s: float) -> list[int]:
        self._named.wait(deadline_s)
        return self._pids

    def wait(self, deadline_s: float) -> tuple[int, str, str]:
        """The bench's status, stdout and stderr once it ends; an assertion
        naming what it printed when it has not ended within ``deadline_s``."""
        try:
            self.proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # its stacks, where it is stuck, into its stderr
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.close()
            raise AssertionError(f"the bench did not end within {deadline_s} s; its stderr ended with: "
                                 + "".join(self.err)[-6000:]) from None
        for t in self._threads:
            t.join(timeout=10)
        return self.proc.returncode, "".join(self.out), "".join(self.err)

    def close(self) -> None:
        """Kill the bench if it still runs (its own cleanup then does not run)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for t in self._threads:
            t.join(timeout=10)


def test_load_specs():
    assert parse_load("4") == (4, "busy") and parse_load("2:bursty") == (2, "bursty")
    assert parse_load(None) == (0, "busy")
    for bad in ("x", "2:spin", "-1"):
        with pytest.raises(ValueError):
            parse_load(bad)


def test_the_load_runs_through_the_sweep_and_is_gone_after(tmp_path):
    bench = _Bench(["allreduce", "-n", "2", "--sizes", "8,32K", "--iters", "20", "--warmup", "2", "--compare", "mpi",
                    "--background-load", "2:bursty", "--json", "r.json"], tmp_path)
    try:
        pids = bench.pids(60)
        assert len(pids) == 2, "no load pids within 60 s; stderr: " + "".join(bench.err)
        # started before the sweep (on a busy machine a new process may not show its command line at once:
        # a wait for that, with a deadline; one that died stays not running and fails here)
        end = time.monotonic() + 10
        while not all(_running(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.01)
        assert all(_running(p) for p in pids), [(p, _state(p)) for p in pids]
        with open(f"/proc/{pids[0]}/cmdline", "rb") as f:
            assert b"bursty" in f.read()
        status, out, err = bench.wait(180)
    finally:
        bench.close()
    assert status == 0, out[-2000:] + err[-2000:]
    assert "2 of 2 still running at the end of the sweeps" in err  # none died during the sweep
    assert [p for p in pids if _state(p) is not None] == []  # reaped, not even a zombie
    doc = json.loads((tmp_path / "r.json").read_text())
    load = doc["background_load"]
    assert load["n"] == 2 and load["kind"] == "bursty" and load["pids"] == pids and load["alive_at_end"] == 2
    assert "# background load: 2 bursty processes" in out
    assert "p99(us)" in out and "mpich-p99" in out
    assert all("time_us_p99" in r for r in doc["results"])


def _endless_bench(load: str, cwd, sigint_ignored: bool = False) -> _Bench:
    """A bench that would run for hours under ``--background-load load``, started."""
    return _Bench(["allreduce", "-n", "2", "--sizes", "8", "--iters", "100000000", "--warmup", "1",
                   "--background-load", load], cwd, sigint_ignored)


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored"])
def test_ctrl_c_stops_the_load(tmp_path, sigint_ignored):
    """Ctrl-C as soon as the bench names its load; also where the bench
    started with SIGINT ignored (a CI job or a script's background job)."""
    bench = _endless_bench("2:busy", tmp_path, sigint_ignored)
    try:
        pids = bench.pids(60)
        assert len(pids) == 2, "no load pids within 60 s; stderr: " + "".join(bench.err)
        bench.proc.send_signal(signal.SIGINT)
        status, out, err = bench.wait(60)
    finally:
        bench.close()
    assert status == 130, err[-2000:]
    assert [p for p in pids if _state(p) is not None] == []


def test_a_bench_started_with_sigint_ignored_takes_ctrl_c_before_its_ranks_start():
    """The bench stops on Ctrl-C from its start, not only once the launcher
    runs its ranks: a Ctrl-C between the two was lost, and the bench ran on."""
    probe = ("import signal; from collectives.bench.cli import _ctrl_c_stops_the_bench; "
             "before = signal.getsignal(signal.SIGINT); _ctrl_c_stops_the_bench(); "
             "print(before is signal.SIG_IGN, signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    res = subprocess.run(["bash", "-c", 'trap "" INT; exec "$@"', "bash", sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["True", "True"], res.stdout + res.stderr


def test_a_killed_bench_leaves_no_load_behind(tmp_path):
    bench = _endless_bench("2:bursty", tmp_path)
    try:
        pids = bench.pids(60)
        assert len(pids) == 2, "no load pids within 60 s; stderr: " + "".join(bench.err)
        bench.proc.kill()  # SIGKILL: no code of the bench runs
        bench.wait(30)
    finally:
        bench.close()
    assert _wait_gone(pids, 30) == []  # the kernel's parent-death signal


def test_an_exception_in_the_block_stops_the_load():
    with pytest.raises(RuntimeError):
        with BackgroundLoad(2, "busy") as load:
            pids = load.pids
            assert load.alive() == 2
            raise RuntimeError("boom")
    assert [p for p in pids if _state(p) is not None] == []


# -- JAX: the in-jit allreduce against mpi4jax -------------------------------------------------------


def test_jax_compare_prints_both_and_the_ratio(tmp_path):
    pytest.importorskip("jax")
    from collectives.bench.jax_compare import mpi4jax_available

    ok, why = mpi4jax_available()
    if not ok:
        pytest.skip(why)
    res = subprocess.run([sys.executable, "-m", "collectives.bench.jax_compare", "-n", "2", "--sizes", "8,4K",
                          "--rounds", "1", "--iters", "5", "--json", "j.json"], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "# wrong results: 0" in res.stdout
    lines = [ln.split() for ln in res.stdout.splitlines() if ln and not ln.startswith("#")]
    assert [ln[:2] for ln in lines] == [["computed", "8"], ["computed", "4096"], ["argument", "8"],
                                        ["argument", "4096"]]
    assert all(float(ln[-1]) > 0 for ln in lines)  # the ratio column
    assert "mpi4jax: mpi4jax" in res.stdout and "allreduce_tree_in_jit" in res.stdout
    data = json.loads((tmp_path / "j.json").read_text())
    assert {r["side"] for r in data["rounds"]} == {"ours", "mpi4jax"}
    assert {(row["operand"], row["size"]) for r in data["rounds"] for row in r["rows"]} == {
        (kind, size) for kind in ("computed", "argument") for size in (8, 4096)}
