"""Performance model of data-parallel CNN training on P nodes.

After Castello, Dolz, Quintana-Orti and Duato, "Theoretical Scalability
Analysis of Distributed Deep Convolutional Neural Networks" (CCGRID 2019,
HPML workshop). One training step on each of P nodes, each with a batch of
``b`` samples:

1. Per layer, three GEMMs (:func:`~.compute.layer_gemms`): forward propagation (FP),
   backward gradient computation (BP-GC, the gradient with respect to the
   layer's input) and backward weight update (BP-WU, the gradient with
   respect to the weights). Convolutions go through im2col.
2. Node time of a GEMM by the roofline model (:meth:`~.compute.Node.gemm_time`):
   ``flops / min(peak, bandwidth * intensity)``, with the arithmetic
   intensity of a cache-blocked GEMM (GotoBLAS / BLIS blocks m_c, n_c, k_c)
   or of an unblocked one (:meth:`~.compute.Gemm.intensity`).
3. Per layer, an allreduce of the layer's weight gradients among the P
   nodes, MST or BKT, on a star or a 2-D mesh (:func:`~.communication.allreduce_time`).
4. Overlap (:func:`schedule`): the allreduce of layer l starts once its
   weight gradient is computed and runs while the layers below it compute
   theirs; allreduces share the network, one at a time.

Choices this package makes where the model leaves room (each documented where
it is made): the first layer computes no BP-GC (nothing needs the gradient
of the input data); pooling layers have no GEMM and cost their memory
traffic; the reduction arithmetic of an allreduce costs ``gamma`` per byte.

What it gives on the paper's cluster (four CNNs at 1000 nodes, star and
2-D mesh) is in docs/training-model.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Sequence

from .communication import Link, allreduce_time
from .compute import WORD_BYTES, Node, layer_gemms
from .networks import Layer, Network

__all__ = ["Cluster", "LayerCost", "StepPrediction", "PHASES", "schedule", "predict", "scan"]

PHASES = ("fp", "bp_gc", "bp_wu")


@dataclass(frozen=True)
class Cluster:
    """A cluster of identical nodes.

    Attributes:
        name: label.
        node: the node model.
        link: the network model.
        max_nodes: nodes available (predictions beyond it are allowed, flagged in the CLI).
        description: where the numbers come from.
    """

    name: str
    node: Node
    link: Link
    max_nodes: int = 1
    description: str = ""

    def with_link(self, gbits_per_s: float | None = None, latency_us: float | None = None) -> "Cluster":
        """A copy with another link bandwidth (Gb/s) and/or latency (us); an
        overridden link is the plain alpha-beta-gamma one (no profile)."""
        link = self.link
        if gbits_per_s is not None:
            link = replace(link, beta=8.0 / (gbits_per_s * 1e9), params=None)
        if latency_us is not None:
            link = replace(link, alpha=latency_us * 1e-6, params=None)
        return replace(self, link=link)


@dataclass(frozen=True)
class LayerCost:
    """Per-layer times of one step on one node (seconds).

    Attributes:
        name, kind: the layer's.
        fp, bp_gc, bp_wu: compute times of the three GEMMs (pooling: its memory
            traffic, forward in ``fp`` and backward in ``bp_gc``).
        grad_bytes: bytes of the layer's weight gradient.
        allreduce: time of its gradient allreduce.
        algorithm: allreduce algorithm used (``"none"`` when nothing is sent).
        allreduce_start, allreduce_end: when the allreduce runs, from the
            start of the step (with overlap; otherwise after all compute).
    """

    name: str
    kind: str
    fp: float
    bp_gc: float
    bp_wu: float
    grad_bytes: int
    allreduce: float
    algorithm: str
    allreduce_start: float = 0.0
    allreduce_end: float = 0.0


@dataclass(frozen=True)
class StepPrediction:
    """Predicted training step of a network on a cluster.

    Attributes:
        network, cluster: names.
        nodes: P.
        batch_per_node: samples per node and step.
        topology, allreduce, overlap, models: the options used.
        compute: FP + BP time of one node, seconds.
        communication: sum of the gradient allreduce times, seconds.
        exposed_communication: ``step - compute`` (communication not hidden).
        step: time of one step, seconds.
        images_per_second: ``P * batch / step``.
        efficiency: ``images_per_second / (P * images_per_second at P=1)``,
            i.e. ``compute / step``.
        bound: ``"compute"`` if compute >= communication, else ``"communication"``.
        layers: per-layer costs.
    """

    network: str
    cluster: str
    nodes: int
    batch_per_node: int
    topology: str
    allreduce: str
    overlap: bool
    models: str
    compute: float
    communication: float
    exposed_communication: float
    step: float
    images_per_second: float
    efficiency: float
    bound: str
    layers: tuple[LayerCost, ...] = field(default=(), repr=False)

    def as_dict(self, layers: bool = False) -> dict:
        """Plain dict for JSON (per-layer costs only when asked)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "layers"}
        if layers:
            out["layers"] = [asdict(c) for c in self.layers]
        return out


def _pool_times(layer: Layer, batch: int, node: Node) -> tuple[float, float]:
    """Forward and backward time of a pooling layer: memory-bound streaming.

    Forward reads the input and writes the output; backward reads the
    output gradient and the input (or the argmax) and writes the input
    gradient: ``(in + out)`` and ``(2 in + out)`` words per sample.
    """
    words_in, words_out = layer.in_elements * batch, layer.out_elements * batch
    return (node.memory_time(WORD_BYTES * (words_in + words_out)),
            node.memory_time(WORD_BYTES * (2 * words_in + words_out)))


def _compute_costs(layer: Layer, batch: int, node: Node, first: bool) -> tuple[float, float, float]:
    if layer.kind == "pool":
        fp, bp = _pool_times(layer, batch, node)
        return fp, (0.0 if first else bp), 0.0
    gemms = layer_gemms(layer, batch)
    fp, gc, wu = (node.gemm_time(gemms[p]) for p in PHASES)
    return fp, (0.0 if first else gc), wu


def schedule(costs: Sequence[LayerCost], overlap: bool) -> tuple[list[LayerCost], float, float]:
    """Place the gradient allreduces of one step in time.

    Forward runs layer 1..L, backward L..1; in the backward pass of layer l
    BP-WU comes first (its gradient is then ready), then BP-GC. With overlap
    the allreduce of layer l starts at ``max(ready_l, end of the previous
    allreduce)``: it runs during the backward pass of the layers below, one
    allreduce at a time on the network. Without overlap all allreduces run
    back to back after the backward pass.

    Args:
        costs: per-layer costs in forward order (times of the allreduces set).
        overlap: overlap communication with the backward pass.

    Returns:
        (costs with allreduce_start / allreduce_end set, compute time, step time).
    """
    compute = sum(c.fp + c.bp_gc + c.bp_wu for c in costs)
    clock = sum(c.fp for c in costs)
    net_free = 0.0
    placed: dict[int, LayerCost] = {}
    for index in range(len(costs) - 1, -1, -1):
        cost = costs[index]
        clock += cost.bp_wu
        ready = clock if overlap else compute
        start = max(ready, net_free)
        net_free = start + cost.allreduce if cost.allreduce > 0 else net_free
        placed[index] = replace(cost, allreduce_start=start, allreduce_end=start + cost.allreduce)
        clock += cost.bp_gc
    step = max(compute, net_free)
    return [placed[i] for i in range(len(costs))], compute, step


def predict(network: Network, cluster: Cluster, nodes: int, batch_per_node: int, topology: str = "star",
            allreduce: str = "auto", overlap: bool = True, models: str = "paper",
            layer_times: Sequence[tuple[float, float, float]] | None = None) -> StepPrediction:
    """Predict one data-parallel training step.

    Args:
        network: the layer table.
        cluster: node and network model.
        nodes: P >= 1.
        batch_per_node: samples per node per step.
        topology: ``"star"`` or ``"mesh"``.
        allreduce: an algorithm of ``models`` or ``"auto"`` (fastest per
            layer); see :func:`allreduce_time`.
        overlap: overlap gradient allreduces with the backward pass.
        models: ``"paper"`` (MST and BKT closed forms) or ``"library"`` (the
            library's per-algorithm cost models with the link's profile).
        layer_times: per layer, measured (FP, BP-GC, BP-WU) seconds at
            ``batch_per_node`` that replace the node's roofline times (for
            example a single node's measured step spread over the layers).

    Returns:
        The prediction, with per-layer costs.

    Raises:
        ValueError: nodes or batch below 1, unknown topology, allreduce or
            model set, or ``layer_times`` of the wrong length.
    """
    if nodes < 1 or batch_per_node < 1:
        raise ValueError(f"nodes and batch_per_node must be >= 1, got {nodes} and {batch_per_node}")
    if layer_times is not None and len(layer_times) != len(network.layers):
        raise ValueError(f"layer_times has {len(layer_times)} entries for {len(network.layers)} layers")
    costs = []
    for index, layer in enumerate(network.layers):
        if layer_times is None:
            fp, gc, wu = _compute_costs(layer, batch_per_node, cluster.node, first=index == 0)
        else:
            fp, gc, wu = (float(t) for t in layer_times[index])
        grad_bytes = layer.params * WORD_BYTES
        t_ar, algo = allreduce_time(grad_bytes, nodes, cluster.link, allreduce, topology, models)
        costs.append(LayerCost(layer.name, layer.kind, fp, gc, wu, grad_bytes, t_ar, algo))
    placed, compute, step = schedule(costs, overlap)
    communication = sum(c.allreduce for c in placed)
    return StepPrediction(
        network=network.name, cluster=cluster.name, nodes=nodes, batch_per_node=batch_per_node,
        topology=topology, allreduce=allreduce, overlap=overlap, models=models, compute=compute,
        communication=communication, exposed_communication=step - compute, step=step,
        images_per_second=nodes * batch_per_node / step if step else math.inf,
        efficiency=compute / step if step else 1.0,
        bound="compute" if compute >= communication else "communication",
        layers=tuple(placed),
    )


def scan(network: Network, cluster: Cluster, nodes: Iterable[int], batch_per_node: int, **options) -> list[StepPrediction]:
    """:func:`predict` for each node count (same options)."""
    return [predict(network, cluster, p, batch_per_node, **options) for p in nodes]
