"""The ``collectives`` command line.

Subcommands: ``run`` (start N local ranks), ``bench`` (microbenchmarks) and
those that plugins add. Each subcommand module exposes ``main(argv)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from typing import Sequence

__all__ = ["main"]

#: subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS = {
    "run": ("collectives.cli", "start N ranks of a script or program on this host or on several "
                               "(like torchrun, mpiexec -n)"),
    "bench": ("collectives.bench.cli", "OSU / nccl-tests style microbenchmarks"),
    "calibrate": ("collectives.cost_models.calibrate", "measure alpha, beta, gamma and memory bandwidth of a transport"),
    "explain": ("collectives.cost_models.explain", "predicted time of every algorithm and the choice "
                                                   "(--hosts 2x4: flat or hierarchical, on several hosts)"),
    "model": ("collectives.cost_models.training.cli", "training-time what-if for P nodes"),
    "trace": ("collectives.trace_cli", "analyze flight records (who is at fault), merge timelines"),
    "settings": ("collectives.config", "every COLLECTIVES_* environment variable, its type, default and meaning"),
}


RUN_FORMS = """\
what every rank runs (as mpiexec takes it):
  collectives run -n 4 train.py ARGS             a .py file: run by this Python
  collectives run -n 4 -m package.module ARGS    a module: run by this Python (python -m)
  collectives run -n 4 ./tool ARGS               an executable file: run as given
  collectives run -n 4 python train.py ARGS      a program on PATH: run as given
  collectives run -n 4 python -m package.module
  collectives run -n 4 /bin/echo hi
Any other file (a script without .py, a .pyz) runs under this Python, and so
does a directory with __main__.py that is not a program on PATH. A file of
that name here comes before a program on PATH. Options after the program or
script are its own.

several nodes: one launcher per node, node 0's serving the rendezvous, e.g.
  collectives run --nnodes 2 --node-rank 0 --master-addr host0 -n 4 train.py   (on host0)
  collectives run --nnodes 2 --node-rank 1 --master-addr host0 -n 4 train.py   (on host1)
Give every node the same COLLECTIVES_SECRET: otherwise node 0 makes one and
sends it to the others in the clear (see docs/launching.md).

exit status: 0 if every rank succeeded; else the first failing rank's status
(128 + N if signal N killed it), 128 + N if the launcher got signal N
(SIGTERM, SIGINT, SIGHUP), 124 on --timeout, 127 if the program is not found,
126 if it cannot be run. No rank outlives the launcher, even one killed with
SIGKILL.
"""


def rank_command(program: str, args: Sequence[str], module: str | None = None) -> list[str]:
    """The argv every rank runs for ``collectives run [-m module] program args``
    (see :data:`RUN_FORMS`). Raises FileNotFoundError naming ``program`` when
    it is neither a file, a directory nor a program on PATH."""
    if module:
        return [sys.executable, "-m", module, *([program] if program else []), *args]
    if program.endswith(".py"):
        if not os.path.exists(program):
            raise FileNotFoundError(f"{program}: no such file")
        return [sys.executable, program, *args]
    if os.path.isfile(program):
        if os.access(program, os.X_OK):  # as a path, not a name to look up on PATH
            return [program if os.sep in program else os.path.join(os.curdir, program), *args]
        return [sys.executable, program, *args]
    if shutil.which(program):
        return [program, *args]
    if os.path.exists(program):
        return [sys.executable, program, *args]
    where = "no such file" if os.sep in program else "no such file, and no program of that name on PATH"
    raise FileNotFoundError(f"{program}: {where}")


def run_main(argv: Sequence[str]) -> int:
    """``collectives run -n N [options] (script.py | -m module | program) args...``"""
    from .errors import BadArgument

    try:
        ap = _run_parser()
    except BadArgument as exc:  # a COLLECTIVES_* default that is not of its type
        print(f"collectives run: {exc}", file=sys.stderr)
        return 2
    ns = ap.parse_args(argv)
    if not ns.script and not ns.module:
        ap.error("a script, a program or -m module is required")
    if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        ap.error(f"--node-rank {ns.node_rank} is not one of 0 to {ns.nnodes - 1} (--nnodes {ns.nnodes})")
    try:
        cmd = rank_command(ns.script, ns.args, ns.module)
    except FileNotFoundError as exc:
        print(f"collectives run: {exc}", file=sys.stderr)
        return 127
    common = dict(transport=ns.transport, prefix=not ns.no_prefix, timeout=ns.timeout,
                  on_failure=ns.on_failure, bind=ns.bind)
    if ns.nnodes == 1:
        from .launcher import LaunchStopped, launch

        try:
            return launch(cmd, ns.nprocs, **common)
        except LaunchStopped as stopped:
            return stopped.status
    from .multinode import launch_nodes

    try:
        return launch_nodes(cmd, ns.nprocs, nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                            master_port=ns.master_port, join_timeout=ns.join_timeout, **common)
    except ValueError as exc:
        print(f"collectives run: {exc}", file=sys.stderr)
        return 2


def _run_parser() -> argparse.ArgumentParser:
    from . import config

    ap = argparse.ArgumentParser(prog="collectives run", epilog=RUN_FORMS,
                                 description="start N ranks of a script or program on this node",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--nprocs", "--nproc-per-node", type=int, default=os.cpu_count() or 1,
                    help="number of ranks on this node")
    ap.add_argument("--transport", default=None, help="transport name (default: automatic)")
    ap.add_argument("--timeout", type=float, default=None, help="stop every rank after this many seconds")
    ap.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    ap.add_argument("--on-failure", choices=("stop", "continue"), default="stop",
                    help="when a rank fails: stop every rank (default), or let the others go on, e.g. to "
                         "shrink to the survivors (the job's status is then the first failure's)")
    ap.add_argument("--bind", choices=("auto", "core", "none"), default=None,
                    help="auto (default, COLLECTIVES_BIND): each rank to a share of the cores of its own, or "
                         "rank i to core i (round robin) when the ranks outnumber the cores; core: rank i to "
                         "core i always; none: unbound")
    nodes = ap.add_argument_group("several nodes (one launcher per node)")
    nodes.add_argument("--nnodes", type=int, default=config.get("NNODES"),
                       help="number of nodes (default 1: COLLECTIVES_NNODES)")
    nodes.add_argument("--node-rank", type=int, default=config.get("NODE_RANK"),
                       help="this node's index, 0 to nnodes - 1; node 0 serves the rendezvous "
                            "(COLLECTIVES_NODE_RANK)")
    nodes.add_argument("--master-addr", default=config.get("MASTER_ADDR"),
                       help="node 0's host, as the other nodes reach it (default 127.0.0.1: "
                            "COLLECTIVES_MASTER_ADDR)")
    nodes.add_argument("--master-port", type=int, default=config.get("MASTER_PORT"),
                       help="the port node 0's launcher listens on (default 29500: COLLECTIVES_MASTER_PORT)")
    nodes.add_argument("--join-timeout", type=float, default=config.get("JOIN_TIMEOUT"),
                       help="seconds for every node to join (default 300: COLLECTIVES_JOIN_TIMEOUT)")
    ap.add_argument("-m", dest="module", default=None, help="run a module under this Python (like python -m)")
    ap.add_argument("script", nargs="?", help="a .py script, or the program every rank runs (see below)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script or program")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``collectives`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from . import __version__, compiled

        print(f"collectives {__version__} (compiled fast path {'built' if compiled.built else 'not built'}, "
              f"Python {sys.version.split()[0]})")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        out = sys.stdout if argv else sys.stderr  # no subcommand is a mistake: usage on stderr, status 2
        print("usage: collectives [--version] SUBCOMMAND [options]\n\nsubcommands:", file=out)
        for name, (_, help_) in SUBCOMMANDS.items():
            print(f"  {name:10s} {help_}", file=out)
        print("\n'collectives SUBCOMMAND --help' tells more.", file=out)
        return 0 if argv else 2
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
    from .launcher import LaunchStopped

    try:
        return int(mod.main(rest) or 0)
    except LaunchStopped as stopped:  # a job it ran was stopped by a signal to this process: so is it
        print(f"collectives {name}: stopped ({stopped})", file=sys.stderr)
        return stopped.status


if __name__ == "__main__":
    sys.exit(main())
