"""Plots of bench results (matplotlib, optional): busbw and time versus size,
one panel per collective, a line per (peer, algorithm), log axes; written as
PNG and SVG."""

from __future__ import annotations

import os
from typing import Any, Sequence

__all__ = ["plot_results"]

_PEER_NAMES = {"mpi": "MPICH (mpi4py)", "gloo": "Gloo (torch)"}


def _series(row: dict[str, Any]) -> tuple[str, str, str]:
    """(peer, algorithm, mode); "auto:ring" and "auto:mst" are one series, "auto"."""
    return row["peer"], row["algorithm"].split(":", 1)[0], row["mode"]


def _label(series: tuple[str, str, str]) -> str:
    peer, algo, mode = series
    name = _PEER_NAMES.get(peer, f"{peer}:{algo}")
    return name + ("" if mode == "inplace" else " (out of place)")


def plot_results(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> list[str]:
    """Write ``<stem>.png`` and ``<stem>.svg``; returns the paths (empty without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    colls = [c for c in dict.fromkeys(r["collective"] for r in rows) if c != "barrier"]
    if not colls:
        return []
    fig, axes = plt.subplots(2, len(colls), figsize=(4.2 * len(colls), 7), squeeze=False)
    for j, coll in enumerate(colls):
        mine = [r for r in rows if r["collective"] == coll and r["size"] > 0]
        for series in dict.fromkeys(_series(r) for r in mine):
            pts = sorted((r["size"], r["busbw"], r["time_us"]) for r in mine if _series(r) == series)
            name = _label(series)
            style = "-" if series[0] == "ours" else "--"
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=name)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], style, marker=".", label=name)
        axes[0][j].set_title(coll)
        axes[0][j].set_ylabel("busbw (GB/s)")
        axes[1][j].set_ylabel("time (us)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (B)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][j].legend(fontsize=6)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    stem = os.path.splitext(path)[0]
    written = []
    for ext in (".png", ".svg"):
        fig.savefig(stem + ext, dpi=110)
        written.append(stem + ext)
    plt.close(fig)
    return written
