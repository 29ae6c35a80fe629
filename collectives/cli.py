"""The ``collectives`` command line.

Subcommands: ``run`` (start N local ranks), ``bench`` (microbenchmarks) and
those that plugins add. Each subcommand module exposes ``main(argv)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

__all__ = ["main"]

#: subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS = {
    "run": ("collectives.cli", "start N local ranks of a script (like torchrun --standalone)"),
    "bench": ("collectives.bench.cli", "OSU / nccl-tests style microbenchmarks"),
    "calibrate": ("collectives.cost_models.calibrate", "measure alpha, beta, gamma and memory bandwidth of a transport"),
    "explain": ("collectives.cost_models.explain", "predicted time of every algorithm and the choice"),
    "model": ("collectives.cost_models.training_cli", "training-time what-if for P nodes"),
}


def run_main(argv: Sequence[str]) -> int:
    """``collectives run -n N [--transport NAME] script.py args...``"""
    from .launcher import launch

    ap = argparse.ArgumentParser(prog="collectives run", description=run_main.__doc__)
    ap.add_argument("-n", "--nprocs", type=int, default=os.cpu_count() or 1, help="number of ranks")
    ap.add_argument("--transport", default=None, help="transport name (default: automatic)")
    ap.add_argument("--timeout", type=float, default=None, help="stop every rank after this many seconds")
    ap.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    ap.add_argument("--bind", choices=("auto", "core", "none"), default=None,
                    help="bind rank i to core i (round robin): auto (default, COLLECTIVES_BIND) when the "
                         "ranks outnumber the cores, core always, none never")
    ap.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    ap.add_argument("script", nargs="?", help="the Python script every rank runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    ns = ap.parse_args(argv)
    if ns.module:
        cmd = [sys.executable, "-m", ns.module] + ([ns.script] if ns.script else []) + ns.args
    elif ns.script:
        cmd = [sys.executable, ns.script] + ns.args
    else:
        ap.error("a script or -m module is required")
    return launch(cmd, ns.nprocs, transport=ns.transport, prefix=not ns.no_prefix, timeout=ns.timeout,
                  bind=ns.bind)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``collectives`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: collectives SUBCOMMAND [options]\n\nsubcommands:")
        for name, (_, help_) in SUBCOMMANDS.items():
            print(f"  {name:10s} {help_}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"collectives: unknown subcommand {name!r}; try collectives --help", file=sys.stderr)
        return 2
    if name == "run":
        return run_main(rest)
    module = SUBCOMMANDS[name][0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        print(f"collectives {name}: not available in this installation ({exc})", file=sys.stderr)
        return 2
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
