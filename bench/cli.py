"""``collectives bench``: OSU / nccl-tests style sweeps, side by side with MPI and Gloo.

Examples::

    collectives bench                                   # every collective, shared memory, one rank per core
    collectives bench allreduce -n 2 --algorithm all --sizes 8:64M --compare mpi,gloo --json r.json --plot r.png
    collectives bench allreduce -n 2 --alloc            # our buffers from comm.alloc (shared memory)
    collectives bench allreduce -n 2 --sizes 8,1M --compare mpi,openmpi   # MPICH and Open MPI
    collectives bench alltoall -n 2 --sizes 1M --compare mpi --pages huge # every peer's buffers in huge pages
    collectives bench allreduce -n 2 --sizes 8,32K --compare mpi --background-load 4:bursty --repeat 3
    collectives bench allreduce --baseline r.json       # the change against an earlier run
    collectives bench pingpong -n 2 --sizes 8:1M --compare mpi,openmpi,gloo   # send/recv, one way (osu_latency)
    collectives run -n 4 -m collectives.bench allreduce # under a launcher: the job's ranks run the sweep

The command starts its own ranks (``collectives run`` for ours and Gloo,
MPICH's ``mpiexec`` for ``mpi``, Open MPI's ``mpiexec`` from its own venv for
``openmpi``: :mod:`collectives.bench.openmpi`), one sweep per library in the
same run (``--repeat R``: R interleaved rounds, median of the medians), then
prints the table: size, count, type, redop, root, algorithm, time (p50: the
median of the per-iteration maximum over ranks; p99, min and max too), algbw,
busbw (nccl-tests bus factors) and #wrong (elements that differ from numpy's
result), with time and ratio columns (ours / theirs, at p50 and at p99) per
compared library, and ours / the faster MPI when two ran; then, per
collective, a summary with one line per size: our time per algorithm, the
peers' times, and the ratios of our fastest algorithm and of ``auto``.
``--background-load N[:KIND]`` runs N competing processes (busy or bursty)
through the whole run. ``--pages huge`` or ``small`` places every peer's
buffers in huge or in 4 KiB pages (:mod:`collectives.bench.pages`): reads of
a peer's memory, MPI's and ours, run several times faster from huge pages. Started under a launcher (ours, torchrun or mpiexec),
the process is one rank of the sweep and rank 0 reports; peers need the
bench to start its own ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Sequence

from collectives.arithmetic import parse_bytes
from collectives.environment import detect_launch
from collectives.launcher import launch
from collectives.registry import COLLECTIVES

from .background import KINDS, BackgroundLoad, parse_load
from .pages import PAGES
from .peers import peer_available
from .plot import plot_results
from .report import (baseline_table, merge_repeats, mpi_legend, peer_labels, results_document, summary_table, table,
                     uneven_rounds, validate)
from .sweep import POINT_TO_POINT, REDUCE_OPS, run_sweep

__all__ = ["main", "parse_sizes"]

DEFAULT_SIZES = "8:4M"


def parse_sizes(spec: str, factor: float = 2.0) -> list[int]:
    """``"8:64M"`` -> 8, 16, ..., 64 MiB (times ``factor``); ``"8,1K,1M"`` -> those sizes."""
    if ":" in spec:
        lo, hi = (parse_bytes(s) for s in spec.split(":", 1))
        out, s = [], max(lo, 1)
        while s <= hi:
            out.append(int(s))
            s = max(s * factor, s + 1)
        return out
    return [parse_bytes(s) for s in spec.split(",")]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="collectives bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("collective", nargs="?", default="all",
                    help="a collective, a comma list, or all; pingpong: OSU's latency test between ranks 0 and 1")
    ap.add_argument("-n", "--nprocs", type=int, default=len(os.sched_getaffinity(0)) or 2,
                    help="ranks (default: the cores this process may run on)")
    ap.add_argument("--transport", default=None,
                    help="our transport (default: shm when the bench starts its ranks, else automatic)")
    ap.add_argument("--algorithm", default="auto", help="auto, all, an algorithm name, or a comma list")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="lo:hi (powers of --factor) or a list")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=1000,
                    help="timed iterations for small sizes, fewer from 64 KiB up (OSU's default)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--op", default="sum", choices=sorted(REDUCE_OPS))
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--mode", choices=("inplace", "outplace", "both"), default="inplace",
                    help="allreduce/allgather: in-place, out-of-place or both")
    ap.add_argument("--inplace", dest="mode", action="store_const", const="inplace", help="same as --mode inplace")
    ap.add_argument("--outplace", dest="mode", action="store_const", const="outplace",
                    help="same as --mode outplace")
    ap.add_argument("--alloc", action="store_true", help="our buffers from comm.alloc (shared memory)")
    ap.add_argument("--pages", default="numpy", choices=PAGES,
                    help="every peer's private buffers: as numpy places them, or in huge pages, or in 4 KiB pages "
                         "(cross-memory reads, MPI's and ours, run several times faster from huge pages)")
    ap.add_argument("--rewrite", action="store_true",
                    help="every rank writes the call's inputs before each call, timed with it (as a training step "
                         "writes its gradients): where a peer read a buffer straight, its owner's next write is slower")
    ap.add_argument("--compare", default="",
                    help="comma list of mpi (MPICH, this environment's), openmpi (Open MPI 5, from a venv of its "
                         "own, made once under the cache folder), gloo")
    ap.add_argument("--openmpi-venv", default=None, metavar="DIR",
                    help="Open MPI's venv (default: $XDG_CACHE_HOME/collectives/openmpi-venv)")
    ap.add_argument("--rebuild-openmpi", action="store_true", help="make Open MPI's venv again before the run")
    ap.add_argument("--openmpi-setting", default=None, metavar="NAME",
                    help="Open MPI's launch settings, by name (python -m collectives.bench.openmpi info; "
                         "default: the fastest measured on one host)")
    ap.add_argument("--background-load", default=None, metavar="N[:KIND]",
                    help="N competing processes through the whole run, KIND " + " or ".join(
                        f"{k} ({v})" for k, v in KINDS.items()) + "; default busy")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--plot", default=None, help="write plots (PNG and SVG) with this stem")
    ap.add_argument("--baseline", default=None, help="an earlier --json file to compare with")
    ap.add_argument("--isolate", action="store_true",
                    help="fresh ranks for each (collective, algorithm): no algorithm is timed after another")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole sweep (ours, then each peer) this many times, interleaved, and report "
                         "the median of the medians: steadier numbers on a busy machine")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before every rank is stopped")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write every rank's timeline to DIR (COLLECTIVES_TRACE; merge with "
                         "'collectives trace merge DIR'), each job's in DIR/<job> when the bench starts "
                         "several (--repeat, --isolate); calls then take the full path, slower")
    return ap


def _trace_dir(ns: argparse.Namespace, rep: int, colls: list[str], algorithm: str, njobs: int) -> str:
    """Where one job of ours writes its timelines: ``--trace DIR`` itself for
    the only job, else ``DIR/<job>`` (``round<k>`` with --repeat, then
    ``<collective>-<algorithm>`` with several jobs a round), so that no job
    overwrites another's ``rank<r>.json``."""
    parts = [f"round{rep + 1}"] if ns.repeat > 1 else []
    if njobs > 1:
        parts.append(f"{','.join(colls)}-{algorithm}")
    name = "-".join(parts)
    name = "".join(c if c.isalnum() or c in "-_.," else "_" for c in name)
    return os.path.join(os.path.abspath(ns.trace), name) if name else os.path.abspath(ns.trace)


def _collectives(spec: str, nprocs: int) -> list[str]:
    """The collectives to time: every collective for "all" (not ``pingpong``, which is named alone)."""
    names = list(COLLECTIVES) if spec == "all" else spec.split(",")
    bad = [c for c in names if c not in COLLECTIVES + POINT_TO_POINT]
    if bad:
        raise SystemExit(f"collectives bench: unknown collective(s) {bad}; known: "
                         f"{', '.join(COLLECTIVES + POINT_TO_POINT)}")
    if nprocs < 2 and any(c in POINT_TO_POINT for c in names):
        raise SystemExit("collectives bench: pingpong needs at least 2 ranks (-n 2)")
    return names


def _our_jobs(ns: argparse.Namespace, colls: list[str]) -> list[tuple[list[str], str]]:
    """(collectives, algorithm spec) of each set of our ranks: one set, or with --isolate one
    set per (collective, algorithm), so that no algorithm runs after another in the same process."""
    if not ns.isolate:
        return [(colls, ns.algorithm)]
    from collectives import algorithms_for
    from collectives.registry import transport_class

    caps = transport_class(ns.transport).capabilities
    jobs = []
    for coll in colls:
        if coll in POINT_TO_POINT:
            jobs.append(([coll], "send_recv"))
            continue
        runnable = sorted(n for n, a in algorithms_for(coll).items() if a.needs <= caps)
        wanted = runnable + ["auto"] if ns.algorithm == "all" else ns.algorithm.split(",")
        jobs += [([coll], name) for name in wanted if name == "auto" or name in runnable]
    return jobs


def _sweep_args(ns: argparse.Namespace, colls: list[str], sizes: list[int], out: str, peer: str,
                algorithm: str) -> list[str]:
    modes = ",".join(_modes(ns))
    args = ["--peer", peer, "--collectives", ",".join(colls), "--sizes", ",".join(map(str, sizes)),
            "--algorithm", algorithm, "--dtype", ns.dtype, "--op", ns.op,
            "--root", str(ns.root), "--iters", str(ns.iters), "--warmup", str(ns.warmup), "--modes", modes,
            "--out", out, "--transport", ns.transport]
    return (args + ["--pages", ns.pages] + (["--alloc"] if ns.alloc and peer == "ours" else [])
            + (["--rewrite"] if ns.rewrite else []))


def _run_peer(peer: str, ns: argparse.Namespace, colls: list[str], sizes: list[int], tmp: str,
              algorithm: str = "native") -> dict | None:
    out = os.path.join(tmp, f"{peer}.json")
    cmd = [sys.executable, "-m", "collectives.bench.sweep"] + _sweep_args(ns, colls, sizes, out, peer, algorithm)
    print(f"# {peer}: {ns.nprocs} ranks, {','.join(colls)}, {algorithm}", file=sys.stderr, flush=True)
    if peer == "mpi":
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "PMI_"))}
        status = subprocess.run([shutil.which("mpiexec") or "mpiexec", "-n", str(ns.nprocs)] + cmd,
                                env=env, timeout=ns.timeout).returncode
    elif peer == "openmpi":
        from .openmpi import backing_directory, default_venv, mpiexec_command, mpiexec_env

        venv = ns.openmpi_venv or default_venv()
        with backing_directory() as backing:
            status = subprocess.run(mpiexec_command(venv, ns.nprocs, cmd[1:], _openmpi_setting(ns)),
                                    env=mpiexec_env(venv, backing), timeout=ns.timeout).returncode
    else:
        with _stdout_to_stderr():  # the ranks' progress lines are not part of the table
            status = launch(cmd, ns.nprocs, transport=ns.transport if peer == "ours" else None, prefix=False,
                            timeout=ns.timeout)  # a stop signal raises LaunchStopped (a KeyboardInterrupt)
    if status != 0 or not os.path.exists(out):
        print(f"collectives bench: the {peer} sweep failed (status {status})", file=sys.stderr)
        return None
    with open(out) as f:
        return json.load(f)


def _openmpi_setting(ns: argparse.Namespace) -> str:
    from .openmpi import DEFAULT_SETTING

    return ns.openmpi_setting or DEFAULT_SETTING


def _peer_commands(ns: argparse.Namespace, peers: list[str]) -> dict[str, str]:
    """How each MPI peer was launched, for the legend and the JSON."""
    out = {}
    for peer in peers:
        if peer == "mpi":
            out[peer] = f"{shutil.which('mpiexec') or 'mpiexec'} -n {ns.nprocs}"
        elif peer == "openmpi":
            from .openmpi import default_venv, mpiexec_command

            cmd = mpiexec_command(ns.openmpi_venv or default_venv(), ns.nprocs, [], _openmpi_setting(ns))
            out[peer] = " ".join(cmd)
    return out


def _stdout_to_stderr() -> contextlib.AbstractContextManager:
    return contextlib.redirect_stdout(sys.stderr) if hasattr(sys.stderr, "buffer") else contextlib.nullcontext()


def _modes(ns: argparse.Namespace) -> list[str]:
    return ["inplace", "outplace"] if ns.mode == "both" else [ns.mode]


def _run_here(ns: argparse.Namespace, colls: list[str], sizes: list[int]) -> int:
    """Started under a launcher (ours, torchrun or mpiexec): this process is one rank; rank 0 reports."""
    from .peers import OursRunner

    runner = OursRunner(ns.transport or "auto", ns.alloc, ns.pages)
    if ns.compare and runner.rank == 0:
        print("collectives bench: --compare needs the bench to start its own ranks; ignored under a launcher",
              file=sys.stderr)
    if ns.background_load and runner.rank == 0:
        print("collectives bench: --background-load needs the bench to start its own ranks; ignored under a "
              "launcher", file=sys.stderr)
    try:
        rows = run_sweep(runner, colls, sizes, algorithm=ns.algorithm, dtype=ns.dtype, op=ns.op, root=ns.root,
                         iters=ns.iters, warmup=ns.warmup, modes=_modes(ns), rewrite=ns.rewrite)
    finally:
        runner.close()
    if runner.rank != 0:
        return 0
    return _report(ns, rows, [], {"p": runner.size, "transport": runner.transport})


def _profile(transport: str) -> Any:
    """The transport's cost-model parameters (calibrated or defaults), or None."""
    try:
        from collectives.cost_models.profile import load_profile

        return load_profile(transport)
    except Exception:
        return None


def _report(ns: argparse.Namespace, rows: list[dict[str, Any]], peers: list[str], ours: dict[str, Any],
            load: dict[str, Any] | None = None) -> int:
    """Print the tables, write JSON and plots; status 3 when a result was wrong."""
    pages = {"numpy": "", "huge": " in huge pages, as every peer's", "small": " in 4 KiB pages, as every peer's"}[ns.pages]
    buffers = "comm.alloc (shared memory)" if ns.alloc else "numpy" + pages
    print(f"# collectives bench: {ours['p']} ranks, transport {ours['transport']}, dtype {ns.dtype}, "
          f"op {ns.op}, our buffers {buffers}; time = p50, the median over iterations of the max over ranks; "
          "p99 = their 99th percentile"
          + (f"; each the median of {ns.repeat} rounds" if ns.repeat > 1 else "")
          + ("; fresh ranks per algorithm" if getattr(ns, "isolate", False) else "")
          + ("; every call timed with a write of its inputs before it (--rewrite)" if ns.rewrite else "")
          + "; ratio = ours / theirs (< 1: ours is faster)")
    if load:
        print(f"# background load: {load['n']} {load['kind']} processes ({load['what']}) through the whole run; "
              f"load average {load['loadavg_before']:.2f} before, {load['loadavg_after']:.2f} after")
    commands = _peer_commands(ns, peers)
    legend = mpi_legend(rows, peers, commands)
    if legend:
        print(legend)
    labels = peer_labels(rows, peers)
    print(table(rows, peers, labels))
    if ns.pages == "huge":
        missed = [f"{r['peer']} {r['collective']} {r['size']}" for r in rows if r.get("huge_pages") is False]
        if missed:
            print(f"# not all in huge pages (the kernel gave 4 KiB pages): {', '.join(missed)}")
    summary = summary_table(rows, peers, labels)
    if summary:
        print(summary)
    for line in uneven_rounds(rows):
        print(line)
    wrong = sum(r["wrong"] for r in rows)
    print(f"# wrong results: {wrong}")
    described = {p: {"mpi": next((r.get("mpi") for r in rows if r["peer"] == p and r.get("mpi")), None),
                     "label": labels[p], "command": commands.get(p)} for p in peers}
    doc = results_document(rows, p=ours["p"], transport=ours["transport"], args=vars(ns), peers=described,
                           background_load=load)
    if ns.baseline:
        with open(ns.baseline) as f:
            print(baseline_table(rows, json.load(f), p=ours["p"], transport=ours["transport"]))
    if ns.json:
        errors = validate(doc)
        if errors:
            print("collectives bench: results do not match the schema: " + "; ".join(errors[:5]), file=sys.stderr)
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if ns.plot:
        written = plot_results(rows, ns.plot, f"{ours['p']} ranks, {ours['transport']}", p=ours["p"],
                               params=_profile(ours["transport"]))
        print("# plots: " + (", ".join(written) if written else "matplotlib is not installed"))
    return 0 if wrong == 0 else 3


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``collectives bench``.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every result was right, 3 when one was wrong, 1 when our sweep failed.
    """
    ns = _parser().parse_args(argv)
    if ns.plot:  # before the sweep, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("collectives bench: --plot needs matplotlib: pip install 'collectives[plot]'", file=sys.stderr)
            return 2
    if ns.trace:
        os.environ["COLLECTIVES_TRACE"] = os.path.abspath(ns.trace)  # our ranks inherit it
    colls = _collectives(ns.collective, ns.nprocs)
    sizes = parse_sizes(ns.sizes, ns.factor)
    try:
        n_load, load_kind = parse_load(ns.background_load)
    except ValueError as exc:
        print(f"collectives bench: {exc}", file=sys.stderr)
        return 2
    if ns.openmpi_setting:
        from .openmpi import SETTINGS

        if ns.openmpi_setting not in SETTINGS:
            print(f"collectives bench: unknown --openmpi-setting {ns.openmpi_setting!r}; known: "
                  f"{', '.join(SETTINGS)}", file=sys.stderr)
            return 2
    if detect_launch().launcher != "none":
        return _run_here(ns, colls, sizes)
    ns.transport = ns.transport or "shm"
    _ctrl_c_stops_the_bench()
    peers = []
    for peer in filter(None, ns.compare.split(",")):
        ok, why = peer_available(peer, openmpi_venv=ns.openmpi_venv, rebuild=ns.rebuild_openmpi)
        if ok:
            peers.append(peer)
        else:
            print(f"collectives bench: skipping {peer}: {why}", file=sys.stderr)
    try:
        with BackgroundLoad(n_load, load_kind) as load:
            described = None
            if n_load:
                described = dict(load.describe(), loadavg_before=os.getloadavg()[0])
                print(f"# background load: {n_load} {load_kind} processes, pids "
                      + " ".join(map(str, load.pids)), file=sys.stderr, flush=True)
            got = _run_all(ns, colls, sizes, peers)
            if n_load:
                alive = load.alive()
                described.update(alive_at_end=alive, loadavg_after=os.getloadavg()[0])
                print(f"# background load: {alive} of {n_load} still running at the end of the sweeps; stopping them",
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt as exc:
        print("collectives bench: stopped", file=sys.stderr)
        return getattr(exc, "status", 130)  # LaunchStopped knows its signal
    if got is None:
        return 1
    rows, ours = got
    ran = [p for p in peers if any(r["peer"] == p for r in rows)]
    return _report(ns, rows, ran, ours, described)


def _ctrl_c_stops_the_bench() -> None:
    """Make Ctrl-C (SIGINT) stop the bench even where it started with SIGINT
    ignored, as a background job of a shell without job control does: the
    launcher takes SIGINT over while ranks run, so a bench that ignored it
    until then lost a Ctrl-C that came between starting its load and
    starting its ranks, and ran on."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_all(ns: argparse.Namespace, colls: list[str], sizes: list[int],
             peers: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """Every round: our jobs, then each peer's; the rows (merged over rounds) and our job's header,
    or None when one of our sweeps failed."""
    runs: list[list[dict[str, Any]]] = []
    our_jobs = _our_jobs(ns, colls)
    with tempfile.TemporaryDirectory(prefix="collectives-bench-") as tmp:
        for rep in range(max(ns.repeat, 1)):
            if ns.repeat > 1:
                print(f"# sweep {rep + 1} of {ns.repeat}", file=sys.stderr, flush=True)
            rows = []
            for job_colls, algorithm in our_jobs:
                if ns.trace:
                    os.environ["COLLECTIVES_TRACE"] = _trace_dir(ns, rep, job_colls, algorithm, len(our_jobs))
                ours = _run_peer("ours", ns, job_colls, sizes, tmp, algorithm)
                if ours is None:
                    return None
                rows += ours["rows"]
            for peer in peers:
                got = _run_peer(peer, ns, colls, sizes, tmp)
                if got is not None:
                    rows += got["rows"]
            runs.append(rows)
    rows = merge_repeats(runs) if len(runs) > 1 else runs[0]
    return rows, ours
