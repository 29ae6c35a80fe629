"""Plots of bench results (matplotlib, optional): busbw and time versus size,
one panel per collective, a line per (peer, algorithm), log axes, and, when
a cost model is given, our measured time next to the model's prediction
(dotted) per algorithm; written as PNG and SVG."""

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


def _predicted(rows: Sequence[dict[str, Any]], p: int, params: Any) -> dict[tuple[str, str], list]:
    """Per (collective, algorithm) of ours: sorted (size, measured us, predicted us)."""
    from collectives.cost_models import MODELS, _load, predict

    _load()
    out: dict[tuple[str, str], list] = {}
    for r in rows:
        algo = r["algorithm"]
        if r["peer"] != "ours" or algo.startswith("auto") or r["mode"] != "inplace" or r["size"] <= 0 or (r["collective"], algo) not in MODELS:
            continue
        pred = predict(r["collective"], algo, p, r["size"], params, r.get("dtype", "float32")) * 1e6
        out.setdefault((r["collective"], algo), []).append((r["size"], r["time_us"], pred))
    return {k: sorted(v) for k, v in out.items()}


def _predicted_panel(ax, series: dict[tuple[str, str], list], coll: str) -> None:
    for (c, algo), pts in series.items():
        if c != coll:
            continue
        line, = ax.plot([q[0] for q in pts], [q[1] for q in pts], "-", marker=".", label=algo)
        ax.plot([q[0] for q in pts], [q[2] for q in pts], ":", color=line.get_color())
    ax.set_ylabel("time (us): measured -, predicted :")


def plot_results(rows: Sequence[dict[str, Any]], path: str, title: str = "", *, p: int | None = None,
                 params: Any = None) -> list[str]:
    """Write ``<stem>.png`` and ``<stem>.svg``; returns the paths (empty without matplotlib).

    With ``p`` and cost-model ``params`` a third row of panels shows our
    measured time per algorithm next to its predicted time.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    colls = [c for c in dict.fromkeys(r["collective"] for r in rows) if c != "barrier"]
    if not colls:
        return []
    predicted = _predicted(rows, p, params) if p and params is not None else {}
    nrows = 3 if predicted else 2
    fig, axes = plt.subplots(nrows, len(colls), figsize=(4.2 * len(colls), 3.5 * nrows), squeeze=False)
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
        if predicted:
            _predicted_panel(axes[2][j], predicted, coll)
            axes[2][j].legend(fontsize=6)
        for ax in (axes[i][j] for i in range(nrows)):
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
