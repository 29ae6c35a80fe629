"""`collectives run` leaves no rank behind, however it ends, and reports
signals as shells do. Real launchers, real ranks, real signals; every wait is
bounded and the tests learn that ranks are up from the ranks' own output."""

from __future__ import annotations

import os
import queue
import signal
import select
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

START_SECONDS = 60.0  # for ranks to start on a busy machine
END_SECONDS = 15.0  # for a launcher to end once it should (the grace period is 3 s)
GONE_SECONDS = 10.0  # for processes to be gone once the launcher has ended

# Every rank starts a child in its own process group (as a data loader
# would), says it is up, then, unless the test makes it act, waits at most
# a minute (the longest a leftover could live).
RANK = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
print("up", os.environ["COLLECTIVES_RANK"], os.getpid(), child.pid, flush=True)
{then}
time.sleep(60)
"""


# -- processes -----------------------------------------------------------------

def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def _cmdline(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _processes(match) -> list[int]:
    """Live processes whose command line satisfies ``match``."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and int(p) != os.getpid() and match(_cmdline(p)) and _alive(int(p))]


def _mentioning(text: str):
    return lambda argv: any(text in a for a in argv)


def _watchdog_of(launcher: int):
    return lambda argv: "--watch" in argv and argv[argv.index("--watch") + 1:][:1] == [str(launcher)]


def _wait_gone(pids, seconds: float) -> list[int]:
    """Wait until none of ``pids`` is alive, at most ``seconds``; returns those left."""
    end = time.monotonic() + seconds
    while True:
        left = [p for p in pids if _alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


# -- a launcher under test -----------------------------------------------------

class Job:
    """``collectives run ARGS`` with its output read by threads, so that no
    read blocks the test: lines arrive on a queue, each wait has a deadline."""

    def __init__(self, args: list[str], tmp_path: Path, env: dict[str, str] | None = None,
                 argv: list[str] | None = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "collectives.cli", "run", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=tmp_path, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.said: queue.Queue[str | None] = queue.Queue()  # the launcher's own lines (stderr)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout, self.lines),
                                         daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr, self.said),
                                         daemon=True)]
        for t in self.readers:
            t.start()

    def _read(self, stream, into: list[str], lines: queue.Queue) -> None:
        for line in stream:
            into.append(line)
            lines.put(line)
        lines.put(None)  # the end of the output

    def says(self, text: str, seconds: float = END_SECONDS) -> None:
        """Wait until the launcher writes a line holding ``text`` on its stderr."""
        end = time.monotonic() + seconds
        while True:
            try:
                line = self.said.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                line = None
            assert line is not None, f"the launcher did not say {text!r}: {self.output()}"
            if text in line:
                return

    def ranks_up(self, nprocs: int) -> dict[int, tuple[int, int]]:
        """Wait for every rank's ``up`` line: rank -> (its pid, its child's pid)."""
        up: dict[int, tuple[int, int]] = {}
        end = time.monotonic() + START_SECONDS
        while len(up) < nprocs:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                line = None
            assert line is not None, f"ranks up: {up}; launcher said: {self.output()}"
            words = line.split()
            if "up" in words:
                i = words.index("up")
                up[int(words[i + 1])] = (int(words[i + 2]), int(words[i + 3]))
        return up

    def wait(self, seconds: float = END_SECONDS) -> int:
        """The launcher's exit status (its output is read to the end too)."""
        rc = self.proc.wait(timeout=seconds)
        for t in self.readers:
            t.join(timeout=seconds)
        return rc

    def output(self) -> str:
        return "".join(self.stdout) + "".join(self.stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=END_SECONDS)


@pytest.fixture
def start(tmp_path):
    """Start launchers; afterwards, check that nothing they started is left
    (ranks and their children name tmp_path; watchdogs name their launcher)."""
    jobs: list[Job] = []

    def start_job(args: list[str], env: dict[str, str] | None = None, argv: list[str] | None = None) -> Job:
        jobs.append(Job(args, tmp_path, env, argv))
        return jobs[-1]

    yield start_job
    for job in jobs:
        job.kill()
    left = _wait_gone(_processes(_mentioning(str(tmp_path))), GONE_SECONDS)
    watchdogs = [p for job in jobs for p in _processes(_watchdog_of(job.proc.pid))]
    watchdogs = _wait_gone(watchdogs, GONE_SECONDS)
    for pid in left + watchdogs:
        os.kill(pid, signal.SIGKILL)
    assert not left and not watchdogs, f"left running: {left} {watchdogs}"


def _rank_script(tmp_path: Path, then: str = "") -> str:
    path = tmp_path / "rank.py"
    path.write_text(RANK.format(marker=str(tmp_path), then=textwrap.dedent(then)))
    return str(path)


def _pids(up: dict[int, tuple[int, int]], but: int | None = None) -> list[int]:
    return [pid for r, pair in up.items() if r != but for pid in pair]


# -- the launcher dies ------------------------------------------------------------

def test_a_launcher_killed_with_sigkill_takes_every_rank_and_what_they_started(tmp_path, start):
    job = start(["-n", "3", _rank_script(tmp_path)])
    up = job.ranks_up(3)
    # what the fixture looks for afterwards: the ranks and their children (a child's command
    # line can read empty for a moment after it started: look again until it shows, 10 s at most)
    end = time.monotonic() + 10
    while not set(_pids(up)) <= set(_processes(_mentioning(str(tmp_path)))) and time.monotonic() < end:
        time.sleep(0.05)
    assert set(_pids(up)) <= set(_processes(_mentioning(str(tmp_path))))
    job.proc.kill()
    assert job.proc.wait(timeout=END_SECONDS) == -signal.SIGKILL
    killed = time.monotonic()
    assert _wait_gone(_pids(up), GONE_SECONDS) == [], "processes outlived their launcher"
    assert time.monotonic() - killed < GONE_SECONDS
    # the watchdog, which stopped the ranks' children, has exited (it held the launcher's stderr)
    for t in job.readers:
        t.join(timeout=GONE_SECONDS)
    assert not any(t.is_alive() for t in job.readers)
    assert _processes(_watchdog_of(job.proc.pid)) == []


def test_ranks_die_with_their_launcher_even_without_the_watchdog(tmp_path, start):
    path = tmp_path / "rank.py"
    path.write_text("import os, time\nprint('up', os.environ['COLLECTIVES_RANK'], os.getpid(), 0, flush=True)\n"
                    "time.sleep(60)\n")
    job = start(["-n", "2", str(path)])
    up = job.ranks_up(2)
    watchdogs = _processes(_watchdog_of(job.proc.pid))
    assert len(watchdogs) == 1
    os.kill(watchdogs[0], signal.SIGKILL)
    assert _wait_gone(watchdogs, GONE_SECONDS) == []
    job.proc.kill()
    assert job.proc.wait(timeout=END_SECONDS) == -signal.SIGKILL
    ranks = [pid for pid, _ in up.values()]
    assert _wait_gone(ranks, GONE_SECONDS) == [], "ranks outlived their launcher"


# A program that runs jobs one after another through the launcher's function
# (calibrate's stretch jobs, the bench's sweeps, each retried or followed by
# the next when it fails).
DRIVER = """\
import sys
from collectives.launcher import launch
for job in range(2):
    print("job", job, flush=True)
    print("status", launch([sys.executable, {rank!r}], 2, prefix=False), flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_a_program_that_launches_jobs(tmp_path, start, sig):
    """The stop signal the launcher's handlers took during a job stops the
    program too, once every rank is stopped: ``launch`` raises LaunchStopped
    rather than returning a status the program would take for that job's
    failure (calibrate ran its next stretch job after a SIGTERM)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(rank=_rank_script(tmp_path)))
    job = start([], argv=[sys.executable, str(driver)])
    up = job.ranks_up(2)
    t0 = time.monotonic()
    job.proc.send_signal(sig)
    rc = job.wait()
    out = job.output()
    assert time.monotonic() - t0 < END_SECONDS
    lines = out.splitlines()
    assert rc != 0 and "job 1" not in lines and not [x for x in lines if x.startswith("status ")], out
    assert f"LaunchStopped: the launcher got {sig.name} and stopped every rank" in out, out
    assert [p for p in _pids(up) if _alive(p)] == [], "ranks or their children outlived the launcher"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_the_launcher_stops_every_rank(tmp_path, start, sig):
    job = start(["-n", "2", _rank_script(tmp_path)])
    up = job.ranks_up(2)
    t0 = time.monotonic()
    job.proc.send_signal(sig)
    assert job.wait() == 128 + sig, job.output()
    assert time.monotonic() - t0 < END_SECONDS
    assert f"collectives run: {sig.name}; stopping every rank" in job.output()
    assert [p for p in _pids(up) if _alive(p)] == [], "ranks or their children outlived the launcher"


# -- a rank ends -----------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(tmp_path, start, sig):
    job = start(["-n", "3", _rank_script(tmp_path)])
    up = job.ranks_up(3)
    t0 = time.monotonic()
    os.kill(up[1][0], sig)
    assert job.wait() == 128 + sig, job.output()
    assert time.monotonic() - t0 < END_SECONDS
    assert f"collectives run: rank 1 was killed by {sig.name}; stopping the other ranks" in job.output()
    # the launcher stopped the others, and rank 1's child, before it exited
    assert [p for p in _pids(up, but=1) + [up[1][1]] if _alive(p)] == []


def test_a_rank_that_exits_with_status_3_gives_3(tmp_path, start):
    # rank 1 exits once the test writes a line to the ranks' stdin (the launcher's)
    script = _rank_script(tmp_path, then="""
        if os.environ["COLLECTIVES_RANK"] == "1":
            sys.stdin.readline()
            sys.exit(3)
    """)
    job = start(["-n", "2", script])
    up = job.ranks_up(2)
    t0 = time.monotonic()
    job.proc.stdin.write("go\n")
    job.proc.stdin.flush()
    assert job.wait() == 3, job.output()
    assert time.monotonic() - t0 < END_SECONDS
    assert "collectives run: rank 1 exited with status 3; stopping the other ranks" in job.output()
    assert [p for p in _pids(up) if _alive(p)] == []


def test_with_on_failure_continue_the_status_is_the_first_failure_not_the_lowest_rank(tmp_path, start):
    # rank 3 fails first (status 5); rank 1 only once the launcher said so (status 7)
    script = _rank_script(tmp_path, then="""
        r = os.environ["COLLECTIVES_RANK"]
        if r == "3":
            sys.exit(5)
        if r == "1":
            sys.stdin.readline()
            sys.exit(7)
        sys.exit(0)
    """)
    job = start(["-n", "4", "--on-failure", "continue", script])
    up = job.ranks_up(4)
    job.says("rank 3 exited with status 5; the other ranks go on (--on-failure continue)")
    job.proc.stdin.write("go\n")
    job.proc.stdin.flush()
    assert job.wait() == 5, job.output()
    assert ("collectives run: 2 of 4 ranks failed: rank 3 exited with status 5, rank 1 exited with status 7; "
            "the job's status is the first's") in job.output(), job.output()
    assert [p for p in _pids(up) if _alive(p)] == []


def test_the_timeout_stops_every_rank_with_124(tmp_path, start):
    job = start(["-n", "2", "--timeout", "2", _rank_script(tmp_path)])
    up = job.ranks_up(2)
    assert job.wait(END_SECONDS + 2) == 124, job.output()
    assert "collectives run: timeout after 2.0s; stopping every rank" in job.output()
    assert [p for p in _pids(up) if _alive(p)] == []


def test_children_left_by_ranks_that_succeeded_are_stopped(tmp_path, start):
    script = _rank_script(tmp_path, then="sys.exit(0)")
    job = start(["-n", "2", script])
    up = job.ranks_up(2)
    assert job.wait() == 0, job.output()
    assert [p for p in _pids(up) if _alive(p)] == []


# -- what the ranks run ----------------------------------------------------------

PRINT_ARGS = "import os, sys\nprint('argv', os.environ['COLLECTIVES_RANK'], *sys.argv[1:])\n"


def _python_on_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH finds ``python`` (this interpreter) first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python").exists():
        (bin_dir / "python").symlink_to(sys.executable)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.parametrize("form", ["script.py", "python script.py", "python -m script", "-m script", "script",
                                  "tool", "./tool"])
def test_every_form_of_command_runs_on_every_rank(tmp_path, start, form):
    (tmp_path / "script.py").write_text(PRINT_ARGS)
    (tmp_path / "script").write_text(PRINT_ARGS)  # no suffix, not executable: run by Python
    (tmp_path / "tool").write_text(f"#!{sys.executable}\n{PRINT_ARGS}")  # executable: run as given
    (tmp_path / "tool").chmod(0o755)
    (tmp_path / "python").mkdir()  # a directory here does not hide the program on PATH
    env = {**_python_on_path(tmp_path), "PYTHONPATH": str(tmp_path)}
    job = start(["-n", "2", *form.split(), "x", "-n", "5"], env)
    assert job.wait(START_SECONDS) == 0, job.output()
    for r in range(2):
        assert f"[rank {r}] argv {r} x -n 5\n" in job.stdout, job.output()


def test_an_executable_program_runs_as_given(tmp_path, start):
    job = start(["-n", "2", "/bin/echo", "hi", "-n", "3"])
    assert job.wait(START_SECONDS) == 0, job.output()
    assert sorted(job.stdout) == ["[rank 0] hi -n 3\n", "[rank 1] hi -n 3\n"]


@pytest.mark.parametrize("program,message", [
    ("/nonexistent", "collectives run: /nonexistent: no such file\n"),
    ("missing.py", "collectives run: missing.py: no such file\n"),
    ("no-such-program-anywhere", "collectives run: no-such-program-anywhere: no such file, "
                                 "and no program of that name on PATH\n"),
])
def test_a_missing_program_fails_clearly(tmp_path, start, program, message):
    job = start(["-n", "2", program])
    assert job.wait() == 127
    assert time.monotonic() - job.started < END_SECONDS
    assert "".join(job.stderr) == message
    assert job.stdout == []


def test_a_program_that_cannot_be_run_gives_126(tmp_path, start):
    tool = tmp_path / "tool"
    tool.write_bytes(b"\x00\x01 not a program\n")
    tool.chmod(0o755)
    job = start(["-n", "2", str(tool)])
    assert job.wait() == 126
    assert "".join(job.stderr) == f"collectives run: cannot start rank 0: {tool}: Exec format error\n"
    assert job.stdout == []


def test_a_reader_that_stops_early_neither_hangs_the_job_nor_prints_a_traceback(tmp_path):
    # like `collectives run ... | head -1`: the ranks print far more than a pipe
    # holds after the launcher's reader has gone; every rank still runs to its end
    cmd = [sys.executable, "-m", "collectives.cli", "run", "-n", "2", "--timeout", "120",
           sys.executable, "-c", "for i in range(200000): print(i)"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_SECONDS)
        assert ready, "no rank printed"
        assert proc.stdout.readline().startswith(b"[rank ")
        proc.stdout.close()
        t0 = time.monotonic()
        rc = proc.wait(timeout=END_SECONDS)
        assert time.monotonic() - t0 < END_SECONDS
        err = proc.stderr.read().decode()
        assert rc == 0, err
        assert "Traceback" not in err and "BrokenPipe" not in err, err
    finally:
        proc.kill()
        proc.wait()


# -- sessions, groups and standard input -------------------------------------------

def test_ranks_share_the_launchers_session_each_in_a_group_of_its_own(tmp_path):
    """One session for the job (the kernel's autogroup then holds every rank,
    so a rank that yields hands its core to another), a process group per
    rank (signals meant for the terminal reach the launcher alone)."""
    script = tmp_path / "ids.py"
    script.write_text("import os\nprint('ids', os.getpid(), os.getsid(0), os.getpgid(0), flush=True)\n")
    proc = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "3", str(script)],
                          capture_output=True, text=True, timeout=60, start_new_session=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ids = [tuple(int(v) for v in line.split("ids ")[1].split()) for line in proc.stdout.splitlines() if "ids " in line]
    assert len(ids) == 3, proc.stdout
    assert len({sid for _, sid, _ in ids}) == 1, ids
    assert ids[0][1] not in [pid for pid, _, _ in ids]  # the launcher's session, not a rank's
    assert all(pgid == pid for pid, _, pgid in ids), ids


def test_a_rank_reads_end_of_file_where_the_launchers_input_is_a_terminal(tmp_path):
    """A rank's group is not the terminal's foreground group: reading the
    terminal would stop it, so a terminal is replaced by /dev/null."""
    import pty

    script = tmp_path / "reads.py"
    script.write_text("import sys\nprint('read', repr(sys.stdin.readline()), flush=True)\n")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "2", str(script)],
                              stdin=follower, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    finally:
        os.close(follower)
        os.close(leader)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("read ''") == 2, proc.stdout


def test_a_rank_stopped_in_a_rendezvous_leaves_no_segment(tmp_path):
    """Rank 0 waits in the rendezvous of a communicator rank 1 never joins;
    rank 1 fails once rank 0's segment exists, and the launcher stops rank 0
    there (SIGTERM: no clean-up of its own): the launcher removes the name."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent('''
        import os, sys, time
        import collectives
        job = os.environ["COLLECTIVES_JOB"]
        if os.environ["RANK"] == "0":
            collectives.init(job=job + "-x", timeout=60)
            sys.exit(0)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/dev/shm/coll-{job}-x-0"):
            assert time.monotonic() < deadline, "rank 0 never made its segment"
            time.sleep(0.01)
        with open(sys.argv[1], "w") as f:
            f.write(job)
        sys.exit(3)
    '''))
    job_file = tmp_path / "job"
    res = subprocess.run([sys.executable, "-c", "import sys; from collectives.cli import main; sys.exit(main())",
                          "run", "-n", "2", "--transport", "shm", sys.executable, str(script), str(job_file)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-2000:]
    job = job_file.read_text()
    assert not list(Path("/dev/shm").glob(f"coll-{job}-*")), "a segment was left"
