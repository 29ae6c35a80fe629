"""``collectives model``: training-time what-if for P nodes.

Example::

    collectives model --net resnet50 --nodes 1,2,4,...,1000 --batch-per-node 60 \\
        --topology star --allreduce auto --overlap --cluster skylake
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Sequence

from .clusters import PRESETS, get_cluster
from .communication import ALLREDUCE_MODELS, LIBRARY_ALLREDUCES, MODEL_SETS, TOPOLOGIES
from .model import StepPrediction, scan
from .networks import NETWORKS, get_network

__all__ = ["main", "parse_nodes", "format_table"]


def parse_nodes(text: str) -> list[int]:
    """Parse a node list: ``"1,2,4,...,1000"`` or ``"8"`` or ``"1,10,100"``.

    ``a,b,...,c`` continues the geometric (or, if b/a is not an integer,
    arithmetic) progression from a, b up to c, and ends with c.

    Raises:
        ValueError: malformed list, values below 1.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    out: list[int] = []
    for i, part in enumerate(parts):
        if part != "...":
            out.append(int(part))
            continue
        if len(out) < 2 or i + 1 >= len(parts):
            raise ValueError(f"'...' needs two values before it and one after: {text!r}")
        a, b, end = out[-2], out[-1], int(parts[i + 1])
        ratio_ok = a > 0 and b % a == 0 and b // a > 1
        step = (lambda v: v * (b // a)) if ratio_ok else (lambda v: v + (b - a))
        if not ratio_ok and b <= a:
            raise ValueError(f"'...' needs an increasing progression: {text!r}")
        value = step(b)
        while value < end:
            out.append(value)
            value = step(value)
    if not out or min(out) < 1:
        raise ValueError(f"node counts must be >= 1: {text!r}")
    return sorted(set(out))


def format_table(results: Sequence[StepPrediction]) -> str:
    """Plain-text table of predictions, one row per node count."""
    head = f"{'nodes':>6} {'compute ms':>11} {'comm ms':>9} {'exposed ms':>11} {'step ms':>9} {'images/s':>11} {'eff %':>6}  bound"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.nodes:>6} {r.compute * 1e3:>11.2f} {r.communication * 1e3:>9.2f} "
                    f"{r.exposed_communication * 1e3:>11.2f} {r.step * 1e3:>9.2f} {r.images_per_second:>11.1f} "
                    f"{r.efficiency * 100:>6.1f}  {r.bound}")
    return "\n".join(rows)


def _plot(results: Sequence[StepPrediction], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [r.nodes for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.loglog(nodes, [r.images_per_second for r in results], "o-", label="predicted")
    left.loglog(nodes, [p * results[0].images_per_second / results[0].nodes for p in nodes], "k--", label="linear")
    left.set_xlabel("nodes")
    left.set_ylabel("images/s")
    left.legend()
    right.semilogx(nodes, [r.compute * 1e3 for r in results], "o-", label="compute")
    right.semilogx(nodes, [r.communication * 1e3 for r in results], "s-", label="communication")
    right.semilogx(nodes, [r.step * 1e3 for r in results], "^-", label="step")
    right.set_xlabel("nodes")
    right.set_ylabel("ms per step")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="collectives model", description="Predict data-parallel training step time on P nodes.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--net", default="resnet50", help=f"network: {', '.join(NETWORKS)}")
    ap.add_argument("--nodes", default="1,2,4,...,1000", help="node counts, e.g. 1,2,4,...,1000")
    ap.add_argument("--batch-per-node", type=int, default=60, help="samples per node per step")
    ap.add_argument("--topology", choices=TOPOLOGIES, default="star")
    ap.add_argument("--allreduce", choices=("auto", *dict.fromkeys((*ALLREDUCE_MODELS, *LIBRARY_ALLREDUCES))),
                    default="auto", help="mst or bkt (paper), or a library algorithm with --models library")
    ap.add_argument("--models", choices=MODEL_SETS, default="paper",
                    help="price allreduces with the paper's MST/BKT formulas or the library's cost models")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="overlap gradient allreduces with the backward pass")
    ap.add_argument("--cluster", choices=tuple(PRESETS), default="skylake")
    ap.add_argument("--transport", default="shm", help="calibration profile for --cluster calibrated")
    ap.add_argument("--link-gbps", type=float, default=None, help="override the link bandwidth (Gb/s)")
    ap.add_argument("--latency-us", type=float, default=None, help="override the link latency (us)")
    ap.add_argument("--unblocked", action="store_true", help="roofline with the unblocked GEMM intensity")
    ap.add_argument("--plot", default=None, metavar="FILE", help="plot to FILE (needs matplotlib)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    ap.add_argument("--layers", action="store_true", help="include per-layer costs in the JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``collectives model``."""
    ap = _parser()
    ns = ap.parse_args(argv)
    try:
        network = get_network(ns.net)
        nodes = parse_nodes(ns.nodes)
        options = {"transport": ns.transport, "nodes": max(nodes)} if ns.cluster == "calibrated" else {}
        cluster = get_cluster(ns.cluster, **options)
    except ValueError as exc:
        ap.error(str(exc))
    cluster = cluster.with_link(ns.link_gbps, ns.latency_us)
    if ns.unblocked:
        cluster = replace(cluster, node=replace(cluster.node, blocking=None))
    try:
        results = scan(network, cluster, nodes, ns.batch_per_node, topology=ns.topology, allreduce=ns.allreduce,
                       overlap=ns.overlap, models=ns.models)
    except ValueError as exc:
        ap.error(str(exc))
    counts = network.counts()
    print(f"{network.name}: {counts['fc']} FC / {counts['conv']} CONV / {counts['pool']} POOL, "
          f"{network.params / 1e6:.1f} M parameters; batch {ns.batch_per_node} per node")
    print(f"cluster {cluster.name}: {cluster.description or cluster.node.name}")
    print(f"topology {ns.topology}, allreduce {ns.allreduce} ({ns.models} models), overlap {'on' if ns.overlap else 'off'}"
          f"{', unblocked GEMM' if ns.unblocked else ''}")
    print(format_table(results))
    beyond = [p for p in nodes if p > cluster.max_nodes]
    if beyond:
        print(f"note: {beyond} exceed the {cluster.max_nodes} nodes of {cluster.name}", file=sys.stderr)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump({"network": network.name, "cluster": cluster.name, "description": cluster.description,
                       "results": [r.as_dict(layers=ns.layers) for r in results]}, fh, indent=1)
    if ns.plot:
        try:
            _plot(results, ns.plot, f"{network.name} on {cluster.name} ({ns.topology}, {ns.allreduce})")
        except ImportError:
            print("collectives model: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
