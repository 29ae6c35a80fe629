"""Cluster presets for the training performance model.

- ``skylake``: the cluster of Castello et al. (CCGRID 2019, HPML workshop):
  1000 nodes, each a Xeon Platinum 8180M (28 cores at 2.5 GHz, 64 FP32 flops
  per cycle and core: 4.48 TFLOP/s; 128 GB/s memory), dual-rail EDR
  InfiniBand (200 Gb/s, 0.5 us).
- ``calibrated``: this machine. The link (alpha, beta, gamma) comes from a
  calibration profile of a transport when ``collectives.cost_models.profile``
  offers ``load_profile``; otherwise from the fallback constants
  :data:`FALLBACK_LINK` (shared memory between processes of one host). The
  node (attainable FP32 GEMM rate, memory bandwidth) is measured with numpy.

The reduction cost ``gamma`` of a preset is the time to stream the bytes of
a reduction through memory: a sum reads two operands and writes one, so
``gamma = 3 / memory_bandwidth`` seconds per byte.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from .communication import Link
from .compute import SKYLAKE_BLOCKING, Node
from .model import Cluster

__all__ = ["skylake", "calibrated", "measure_node", "profile_link", "FALLBACK_LINK", "PRESETS", "get_cluster"]

#: Link used by ``calibrated`` when no calibration profile is available:
#: shared memory between two processes of one host (copy through a shared
#: segment, ~5 us per message, ~4 GB/s).
FALLBACK_LINK = Link(alpha=5e-6, beta=1.0 / 4e9, gamma=0.0)


def skylake(nodes: int = 1000) -> Cluster:
    """The paper's cluster: Xeon Platinum 8180M nodes on dual-rail EDR InfiniBand.

    Args:
        nodes: nodes in the cluster.

    Returns:
        The cluster preset.
    """
    node = Node.from_cpu("Xeon Platinum 8180M", cores=28, ghz=2.5, flops_per_cycle=64, mem_gbytes_per_s=128,
                         blocking=SKYLAKE_BLOCKING)
    link = Link.from_rate(200.0, 0.5, gamma=3.0 / node.mem_bandwidth)
    return Cluster("skylake", node, link, nodes, "Xeon Platinum 8180M, 4.48 TFLOP/s, 128 GB/s; dual-rail EDR 200 Gb/s, 0.5 us")


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_node(gemm_size: int = 768, copy_mbytes: int = 64, repeats: int = 3, name: str = "this machine") -> Node:
    """Measure this machine's node: FP32 GEMM rate and memory bandwidth.

    The GEMM rate of a square ``gemm_size`` numpy float32 product stands
    for the peak (what a training step's GEMMs can attain with numpy's BLAS
    and its current threads); the bandwidth is that of a large copy (read
    plus write). Takes about a second.

    Args:
        gemm_size: order of the GEMM.
        copy_mbytes: size of the copied buffer, MB.
        repeats: best of this many runs.
        name: label of the node.

    Returns:
        The node (cache blocks of the Skylake preset).
    """
    a = np.ones((gemm_size, gemm_size), np.float32)
    b = np.ones_like(a)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)
    peak = 2.0 * gemm_size**3 / _best_time(lambda: np.matmul(a, b, out=c), repeats)
    src = np.ones(copy_mbytes * (1 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bandwidth = 2.0 * src.nbytes / _best_time(lambda: np.copyto(dst, src), repeats)
    return Node(name, peak, bandwidth, SKYLAKE_BLOCKING)


def _field(profile: Any, key: str) -> float | None:
    value = profile.get(key) if isinstance(profile, dict) else getattr(profile, key, None)
    return None if value is None else float(value)


def profile_link(transport: str = "shm") -> tuple[Link, str]:
    """The link of a transport's calibration profile, or the fallback.

    Uses ``collectives.cost_models.profile.load_profile(transport)`` when
    that function exists and returns a profile with ``alpha``, ``beta``
    (and optionally ``gamma``), as attributes or keys.

    Args:
        transport: transport whose profile to load.

    Returns:
        (link, where it came from).
    """
    try:
        profiles = importlib.import_module("collectives.cost_models.profile")
        profile = profiles.load_profile(transport)
    except Exception as exc:  # no profile module, function or profile: fall back
        return FALLBACK_LINK, f"fallback constants ({type(exc).__name__}: no calibration profile for {transport!r})"
    source = profile.get("source") if isinstance(profile, dict) else getattr(profile, "source", None)
    if source == "defaults":
        return FALLBACK_LINK, f"fallback constants (no calibration profile for {transport!r})"
    alpha, beta = _field(profile, "alpha"), _field(profile, "beta")
    if alpha is None or beta is None:
        return FALLBACK_LINK, f"fallback constants (profile for {transport!r} has no alpha/beta)"
    pieces = (profile.get("protocol") if isinstance(profile, dict) else getattr(profile, "protocol", None)) or ()
    if pieces:  # latency from the small-message piece, bandwidth from the large one
        alpha = pieces[0][1]
    alpha += _field(profile, "overhead") or 0.0
    params = profile if hasattr(profile, "stretch_at") else None  # the library's models use all of it
    return Link(alpha, beta, _field(profile, "gamma") or 0.0, params), f"calibration profile of {transport!r}"


def calibrated(nodes: int = 2, transport: str = "shm", node: Node | None = None) -> Cluster:
    """A cluster of nodes like this machine, linked as a calibrated transport.

    Args:
        nodes: nodes in the cluster.
        transport: transport whose calibration profile gives alpha, beta, gamma.
        node: node model; measured with :func:`measure_node` when None.

    Returns:
        The cluster; its description says where the link came from.
    """
    node = node or measure_node()
    link, source = profile_link(transport)
    if link.gamma == 0.0:
        link = replace(link, gamma=3.0 / node.mem_bandwidth)
    description = (f"{node.name}: {node.peak_flops / 1e9:.1f} GFLOP/s, {node.mem_bandwidth / 1e9:.1f} GB/s; "
                   f"{transport} link alpha={link.alpha * 1e6:.2f} us, {1e-9 / link.beta:.2f} GB/s from {source}")
    return Cluster(f"calibrated-{transport}", node, link, nodes, description)


PRESETS: dict[str, Callable[..., Cluster]] = {"skylake": skylake, "calibrated": calibrated}


def get_cluster(name: str, **options: Any) -> Cluster:
    """Preset by name (``skylake``, ``calibrated``); options go to the preset function.

    Raises:
        ValueError: unknown preset.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name](**options)
