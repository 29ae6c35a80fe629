"""``collectives trace``: read what the ranks recorded.

    collectives trace analyze DIR          which rank is at fault (flight records)
    collectives trace merge DIR -o FILE    one timeline of every rank (COLLECTIVES_TRACE files)

``merge`` takes one job's directory (``rank<r>.json``) or a directory of
several jobs' (one subdirectory each, as ``collectives bench --trace``
writes them): each job is then merged into FILE's name with ``-<job>``
before its extension.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="collectives trace", description="read what the ranks recorded")
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("analyze", help="name the rank at fault from every rank's flight record")
    a.add_argument("directory", help="where the ranks wrote rank<r>.json (COLLECTIVES_DEBUG_DIR/<job>)")
    m = sub.add_parser("merge", help="merge every rank's timeline into one, and report arrival skew")
    m.add_argument("directory", help="the COLLECTIVES_TRACE directory, or one holding a subdirectory per job")
    m.add_argument("-o", "--out", default="timeline.json", help="the merged timeline (default %(default)s)")
    m.add_argument("--top", type=int, default=10, help="calls with the largest skew to list (default %(default)s)")
    ns = ap.parse_args(argv)
    if ns.what == "analyze":
        from .trace_analysis import report

        try:
            print(report(ns.directory))
        except (FileNotFoundError, ValueError) as exc:
            print(f"collectives trace analyze: {exc}", file=sys.stderr)
            return 1
        return 0
    from .tracing import merge_jobs

    try:
        merged = merge_jobs(ns.directory, ns.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"collectives trace merge: {exc}", file=sys.stderr)
        return 1
    for job, out, summary in merged:
        if len(merged) > 1:
            print(f"job {job}:")
        _print_summary(summary, out, ns.top)
    return 0


def _print_summary(summary: dict, out: str, top: int) -> None:
    skews = summary["skews"]
    print(f"{summary['ranks']} ranks, {summary['calls']} calls -> {out} (open in https://ui.perfetto.dev)")
    if skews:
        mean = sum(s["skew_us"] for s in skews) / len(skews)
        print(f"arrival skew: mean {mean:.1f} us, max {max(s['skew_us'] for s in skews):.1f} us; "
              f"last to arrive most often: rank {summary['last_most_often']}")
        print(f"{'call':>8} {'collective':<15} {'skew us':>10} {'first':>6} {'last':>6}")
        for s in sorted(skews, key=lambda s: -s["skew_us"])[:top]:
            print(f"{s['seq']:>8} {s['collective']:<15} {s['skew_us']:>10.1f} {s['first']:>6} {s['last']:>6}")


if __name__ == "__main__":
    sys.exit(main())
