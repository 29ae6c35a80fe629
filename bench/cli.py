"""``collectives bench``: OSU / nccl-tests style sweeps, side by side with MPI and Gloo.

Examples::

    collectives bench                                   # every collective, shared memory, one rank per core
    collectives bench allreduce -n 2 --algorithm all --sizes 8:64M --compare mpi,gloo --json r.json --plot r.png
    collectives bench allreduce --baseline r.json       # the change against an earlier run

The command starts its own ranks (``collectives run`` for ours and Gloo,
``mpiexec`` for MPI), one sweep per library in the same run, then prints
the table: size, count, type, redop, root, algorithm, time (median of the
per-iteration maximum over ranks; min and max too), algbw, busbw (nccl-tests
bus factors) and #wrong (elements that differ from numpy's result), with a
time and ratio column (ours / theirs) per compared library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from collectives.launcher import launch
from collectives.registry import COLLECTIVES

from .peers import peer_available
from .plot import plot_results
from .report import baseline_table, results_document, table, validate

__all__ = ["main", "parse_sizes"]

DEFAULT_SIZES = "8:4M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in "KMG" else ""
    return int(float(text[:len(text) - len(unit)]) * _UNITS[unit])


def parse_sizes(spec: str, factor: float = 2.0) -> list[int]:
    """``"8:64M"`` -> 8, 16, ..., 64 MiB (times ``factor``); ``"8,1K,1M"`` -> those sizes."""
    if ":" in spec:
        lo, hi = (_bytes(s) for s in spec.split(":", 1))
        out, s = [], max(lo, 1)
        while s <= hi:
            out.append(int(s))
            s = max(s * factor, s + 1)
        return out
    return [_bytes(s) for s in spec.split(",")]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="collectives bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("collective", nargs="?", default="all", help="a collective, a comma list, or all")
    ap.add_argument("-n", "--nprocs", type=int, default=os.cpu_count() or 2, help="ranks (default: cores)")
    ap.add_argument("--transport", default="shm", help="our transport (default shm)")
    ap.add_argument("--algorithm", default="auto", help="auto, all, or an algorithm name")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="lo:hi (powers of --factor) or a list")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=100, help="timed iterations for small sizes")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--op", default="sum")
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--mode", choices=("inplace", "outplace", "both"), default="inplace",
                    help="allreduce/allgather: in-place, out-of-place or both")
    ap.add_argument("--alloc", action="store_true", help="our buffers from comm.alloc (shared memory)")
    ap.add_argument("--compare", default="", help="comma list of mpi, gloo")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--plot", default=None, help="write plots (PNG and SVG) with this stem")
    ap.add_argument("--baseline", default=None, help="an earlier --json file to compare with")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before every rank is stopped")
    return ap


def _collectives(spec: str) -> list[str]:
    names = list(COLLECTIVES) if spec == "all" else spec.split(",")
    bad = [c for c in names if c not in COLLECTIVES]
    if bad:
        raise SystemExit(f"collectives bench: unknown collective(s) {bad}; known: {', '.join(COLLECTIVES)}")
    return names


def _sweep_args(ns: argparse.Namespace, colls: list[str], sizes: list[int], out: str, peer: str) -> list[str]:
    modes = "inplace,outplace" if ns.mode == "both" else ns.mode
    args = ["--peer", peer, "--collectives", ",".join(colls), "--sizes", ",".join(map(str, sizes)),
            "--algorithm", ns.algorithm if peer == "ours" else "native", "--dtype", ns.dtype, "--op", ns.op,
            "--root", str(ns.root), "--iters", str(ns.iters), "--warmup", str(ns.warmup), "--modes", modes,
            "--out", out, "--transport", ns.transport]
    return args + (["--alloc"] if ns.alloc and peer == "ours" else [])


def _run_peer(peer: str, ns: argparse.Namespace, colls: list[str], sizes: list[int], tmp: str) -> dict | None:
    out = os.path.join(tmp, f"{peer}.json")
    cmd = [sys.executable, "-m", "collectives.bench.sweep"] + _sweep_args(ns, colls, sizes, out, peer)
    print(f"# {peer}: {ns.nprocs} ranks", file=sys.stderr, flush=True)
    if peer == "mpi":
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "PMI_"))}
        status = subprocess.run([shutil.which("mpiexec") or "mpiexec", "-n", str(ns.nprocs)] + cmd,
                                env=env, timeout=ns.timeout).returncode
    else:
        status = launch(cmd, ns.nprocs, transport=ns.transport if peer == "ours" else None, prefix=False,
                        timeout=ns.timeout)
    if status != 0 or not os.path.exists(out):
        print(f"collectives bench: the {peer} sweep failed (status {status})", file=sys.stderr)
        return None
    with open(out) as f:
        return json.load(f)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``collectives bench``."""
    ns = _parser().parse_args(argv)
    colls = _collectives(ns.collective)
    sizes = parse_sizes(ns.sizes, ns.factor)
    peers = []
    for peer in filter(None, ns.compare.split(",")):
        ok, why = peer_available(peer)
        if ok:
            peers.append(peer)
        else:
            print(f"collectives bench: skipping {peer}: {why}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="collectives-bench-") as tmp:
        ours = _run_peer("ours", ns, colls, sizes, tmp)
        if ours is None:
            return 1
        rows = list(ours["rows"])
        for peer in peers:
            got = _run_peer(peer, ns, colls, sizes, tmp)
            if got is not None:
                rows += got["rows"]
    ran = [p for p in peers if any(r["peer"] == p for r in rows)]
    print(f"# collectives bench: {ours['p']} ranks, transport {ours['transport']}, dtype {ns.dtype}, "
          f"op {ns.op}; time = median over iterations of the max over ranks")
    print(table(rows, ran))
    wrong = sum(r["wrong"] for r in rows)
    print(f"# wrong results: {wrong}")
    doc = results_document(rows, p=ours["p"], transport=ours["transport"], args=vars(ns))
    if ns.baseline:
        with open(ns.baseline) as f:
            print(baseline_table(rows, json.load(f)))
    if ns.json:
        errors = validate(doc)
        if errors:
            print("collectives bench: results do not match the schema: " + "; ".join(errors[:5]), file=sys.stderr)
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=1)
    if ns.plot:
        written = plot_results(rows, ns.plot, f"{ours['p']} ranks, {ours['transport']}")
        print("# plots: " + (", ".join(written) if written else "matplotlib is not installed"))
    return 0 if wrong == 0 else 3
