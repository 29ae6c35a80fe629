"""Performance model of data-parallel CNN training on P nodes.

After Castello, Dolz, Quintana-Orti and Duato, "Theoretical Scalability
Analysis of Distributed Deep Convolutional Neural Networks" (CCGRID 2019,
HPML workshop). One training step on each of P nodes, each with a batch of
``b`` samples:

1. Per layer, three GEMMs (:func:`layer_gemms`): forward propagation (FP),
   backward gradient computation (BP-GC, the gradient with respect to the
   layer's input) and backward weight update (BP-WU, the gradient with
   respect to the weights). Convolutions go through im2col.
2. Node time of a GEMM by the roofline model (:meth:`Node.gemm_time`):
   ``flops / min(peak, bandwidth * intensity)``, with the arithmetic
   intensity of a cache-blocked GEMM (GotoBLAS / BLIS blocks m_c, n_c, k_c)
   or of an unblocked one (:meth:`Gemm.intensity`).
3. Per layer, an allreduce of the layer's weight gradients among the P
   nodes, MST or BKT, on a star or a 2-D mesh (:func:`allreduce_time`).
4. Overlap (:func:`schedule`): the allreduce of layer l starts once its
   weight gradient is computed and runs while the layers below it compute
   theirs; allreduces share the network, one at a time.

Choices this module makes where the model leaves room (each documented where
it is made): the first layer computes no BP-GC (nothing needs the gradient
of the input data); pooling layers have no GEMM and cost their memory
traffic; the reduction arithmetic of an allreduce costs ``gamma`` per byte.

What the model gives on the paper's cluster (``clusters.skylake``: 1000
Xeon 8180M nodes, 200 Gb/s, 0.5 us; blocked GEMM; batch 60 per node;
``allreduce="auto"``), per step at 1000 nodes, star / 2-D mesh::

    network     compute   comm star / mesh   step (overlap)   step (no overlap)
    AlexNet      96.9 ms    32.9 / 26.3 ms    97.1 / 97.0 ms   129.8 / 123.2 ms
    VGG16      1450.1 ms    70.2 / 58.2 ms  1450.1 / 1450.1   1520.3 / 1508.2 ms
    ResNet-50   334.8 ms    45.5 / 13.9 ms   334.8 / 334.8    380.2 / 348.7 ms
    Inception3  630.0 ms    65.1 / 15.7 ms   630.0 / 630.0    695.1 / 645.7 ms

All four CNNs are compute-bound at batch 60 per node (efficiency >= 99.8 %
with overlap; 75-98 % without), overlap hides nearly all communication, and
doubling the link bandwidth to 400 Gb/s shortens the collectives (ResNet-50
star 45.5 -> 35.0 ms). At 1000 nodes the star's 1-D bucket algorithm pays
``2 (P-1) alpha`` per layer, so networks of many small layers (ResNet-50,
Inception v3) communicate less on the mesh, whose latency term is
``2 (d1 + d2 - 2) alpha``. At batch 1 per node all four are
communication-bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from .networks import Layer, Network

__all__ = [
    "Blocking",
    "SKYLAKE_BLOCKING",
    "Gemm",
    "Node",
    "Link",
    "Cluster",
    "LayerCost",
    "StepPrediction",
    "layer_gemms",
    "mesh_dims",
    "allreduce_time",
    "ALLREDUCE_MODELS",
    "schedule",
    "predict",
    "scan",
]

WORD_BYTES = 4  # FP32
PHASES = ("fp", "bp_gc", "bp_wu")


# --------------------------------------------------------------------------- GEMM


@dataclass(frozen=True)
class Blocking:
    """Cache blocking of a GotoBLAS / BLIS GEMM: A blocks m_c x k_c, B panels k_c x n_c."""

    mc: int = 480
    nc: int = 3072
    kc: int = 384


#: The blocks of BLIS on Skylake (the paper's example).
SKYLAKE_BLOCKING = Blocking(480, 3072, 384)


@dataclass(frozen=True)
class Gemm:
    """``C (m x n) = A (m x k) * B (k x n)``, ``count`` times (groups of a grouped conv)."""

    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        """``2 m n k`` per product."""
        return 2.0 * self.m * self.n * self.k * self.count

    def traffic(self, blocking: Blocking | None = None, word_bytes: int = WORD_BYTES) -> float:
        """Bytes moved between memory and the caches.

        Unblocked (``blocking=None``): each operand crosses once, C is read
        and written: ``mk + kn + 2mn`` words (the compulsory traffic, an
        infinite cache). Blocked, with the GotoBLAS loop order (n_c, k_c,
        m_c): B is packed once (``kn``), A is packed once per n_c panel of B
        (``mk * ceil(n/n_c)``) and each block of C is read and written once
        per k_c slice (``2mn * ceil(k/k_c)``).

        Args:
            blocking: cache blocks, or None for the unblocked GEMM.
            word_bytes: bytes per element.

        Returns:
            Bytes moved by all ``count`` products.
        """
        m, n, k = self.m, self.n, self.k
        if blocking is None:
            words = m * k + k * n + 2 * m * n
        else:
            words = k * n + m * k * math.ceil(n / blocking.nc) + 2 * m * n * math.ceil(k / blocking.kc)
        return float(words) * word_bytes * self.count

    def intensity(self, blocking: Blocking | None = None, word_bytes: int = WORD_BYTES) -> float:
        """Arithmetic intensity, flops per byte (see :meth:`traffic`)."""
        traffic = self.traffic(blocking, word_bytes)
        return self.flops / traffic if traffic else math.inf


def layer_gemms(layer: Layer, batch: int) -> dict[str, Gemm]:
    """The three GEMMs of one layer for a batch of ``batch`` samples.

    With im2col, a convolution of a ``c_i x h_i x w_i`` input by ``c_o``
    filters of ``k_h x k_w`` into ``h_o x w_o`` outputs is a product by the
    ``(k_h k_w c_i) x (b h_o w_o)`` patch matrix; a fully connected layer
    is the case ``k_h = k_w = h_o = w_o = 1`` (``n_l x b = (n_l x n_{l-1})
    (n_{l-1} x b)`` in the paper's notation):

    - FP:    ``Y (c_o x b h_o w_o) = W (c_o x k_h k_w c_i) * X (k_h k_w c_i x b h_o w_o)``
    - BP-GC: ``dX (k_h k_w c_i x b h_o w_o) = W^T (k_h k_w c_i x c_o) * dY (c_o x b h_o w_o)``
    - BP-WU: ``dW (c_o x k_h k_w c_i) = dY (c_o x b h_o w_o) * X^T (b h_o w_o x k_h k_w c_i)``

    A grouped convolution is ``groups`` GEMMs with ``c_i, c_o`` divided by
    the groups. Pooling layers have no GEMM (empty dict).

    Args:
        layer: the layer.
        batch: samples per node.

    Returns:
        ``{"fp": Gemm, "bp_gc": Gemm, "bp_wu": Gemm}``, or ``{}`` for pooling.
    """
    if layer.kind == "pool":
        return {}
    g = layer.groups
    kh, kw = layer.kernel
    rows = layer.out_channels // g
    depth = kh * kw * layer.in_channels // g
    columns = batch * layer.out_size[0] * layer.out_size[1]
    return {
        "fp": Gemm(rows, columns, depth, g),
        "bp_gc": Gemm(depth, columns, rows, g),
        "bp_wu": Gemm(rows, depth, columns, g),
    }


# --------------------------------------------------------------------------- machines


@dataclass(frozen=True)
class Node:
    """A compute node for the roofline model.

    Attributes:
        name: label.
        peak_flops: peak FP32 flop/s.
        mem_bandwidth: memory bandwidth, bytes/s.
        blocking: GEMM cache blocks; None for the unblocked intensity.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    blocking: Blocking | None = SKYLAKE_BLOCKING

    @classmethod
    def from_cpu(cls, name: str, cores: int, ghz: float, flops_per_cycle: int, mem_gbytes_per_s: float,
                 blocking: Blocking | None = SKYLAKE_BLOCKING) -> "Node":
        """Node of ``cores x ghz x flops_per_cycle`` peak and the given memory bandwidth (GB/s)."""
        return cls(name, cores * ghz * 1e9 * flops_per_cycle, mem_gbytes_per_s * 1e9, blocking)

    def gemm_rate(self, gemm: Gemm) -> float:
        """Attainable flop/s of a GEMM: ``min(peak, bandwidth * intensity)``."""
        return min(self.peak_flops, self.mem_bandwidth * gemm.intensity(self.blocking))

    def gemm_time(self, gemm: Gemm) -> float:
        """Seconds of a GEMM by the roofline model: ``flops / min(peak, bw * AI)``."""
        return gemm.flops / self.gemm_rate(gemm) if gemm.flops else 0.0

    def memory_time(self, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` through memory."""
        return nbytes / self.mem_bandwidth


@dataclass(frozen=True)
class Link:
    """Network parameters of the alpha-beta-gamma model.

    Attributes:
        alpha: latency per message, seconds.
        beta: seconds per byte (1 / bandwidth).
        gamma: seconds per byte reduced (the arithmetic of a reduction).
        params: the calibration profile's full cost-model parameters
            (per-message overhead, size ranges, ...) when the link came
            from one; the library's allreduce models use them.
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    params: Any = field(default=None, compare=False)

    @classmethod
    def from_rate(cls, gbits_per_s: float, latency_us: float, gamma: float = 0.0) -> "Link":
        """Link of the given bandwidth (Gb/s) and latency (microseconds)."""
        return cls(latency_us * 1e-6, 8.0 / (gbits_per_s * 1e9), gamma)

    def cost_params(self) -> Any:
        """The library's cost-model parameters
        (:class:`~collectives.cost_models.model.Params`) of this link: those
        of the calibration profile it came from (``params``), else alpha,
        beta and gamma alone. Cluster nodes are separate machines, so a
        profile's sharing of one host's cores (``cores``, ``stretch``) is
        left out."""
        from .model import Params

        if self.params is None:
            return Params(alpha=self.alpha, beta=self.beta, gamma=self.gamma, mem_bandwidth=math.inf)
        return replace(self.params, cores=0, stretch=())


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


# --------------------------------------------------------------------------- allreduce


def mesh_dims(nodes: int) -> tuple[int, int]:
    """The most square ``d1 x d2 = nodes`` factorisation (d1 <= d2); primes give 1 x P."""
    d1 = max(d for d in range(1, math.isqrt(nodes) + 1) if nodes % d == 0)
    return d1, nodes // d1


def _mst(nbytes: float, dims: Sequence[int], link: Link) -> float:
    """MST allreduce = binomial-tree reduce + broadcast, per dimension.

    Chan et al. (2007): reduce ``ceil(log2 d)(alpha + n beta + n gamma)``,
    broadcast ``ceil(log2 d)(alpha + n beta)``; on a mesh each runs along
    one dimension after the other with the whole message, so the costs
    sum over the dimensions.
    """
    steps = sum(math.ceil(math.log2(d)) for d in dims if d > 1)
    return steps * (2 * link.alpha + nbytes * (2 * link.beta + link.gamma))


def _bkt(nbytes: float, dims: Sequence[int], link: Link) -> float:
    """BKT allreduce = bucket (ring) reduce-scatter + allgather, per dimension.

    Chan et al. (2007): on a ring of d nodes with n bytes, reduce-scatter
    ``(d-1) alpha + (d-1)/d n (beta + gamma)``, allgather ``(d-1) alpha +
    (d-1)/d n beta``. On a mesh the reduce-scatter runs along dimension 1
    with n bytes, then dimension 2 with n/d1, ... (the allgather in reverse),
    so the latency terms sum to ``sum (d_i - 1)`` and the bandwidth terms to
    ``(P-1)/P n``.
    """
    total, share = 0.0, float(nbytes)
    for d in dims:
        if d > 1:
            total += 2 * (d - 1) * link.alpha + (d - 1) / d * share * (2 * link.beta + link.gamma)
            share /= d
    return total


#: allreduce name -> T(nbytes, dims, link); a star of P nodes is the 1-D case (P,).
ALLREDUCE_MODELS: dict[str, Callable[[float, Sequence[int], Link], float]] = {"mst": _mst, "bkt": _bkt}
#: The library's allreduce algorithms that need nothing but point-to-point
#: (``models="library"``; ``bkt`` names ``ring`` there).
LIBRARY_ALLREDUCES = ("mst", "ring", "recursive_doubling", "rabenseifner")
#: Which formulas price the allreduces: the paper's closed forms of MST and
#: BKT, or the library's per-algorithm cost models (:mod:`collectives.cost_models`).
MODEL_SETS = ("paper", "library")

TOPOLOGIES = ("star", "mesh")


def _library_allreduce(name: str, nbytes: float, dims: Sequence[int], params: Any) -> float:
    """The library's cost model of allreduce ``name`` over ``dims``.

    A star is one dimension. On a mesh the ring (BKT) reduce-scatters along
    each dimension in turn on a shrinking share and allgathers back, as the
    paper's BKT does; other algorithms run along each dimension with the
    whole message.
    """
    from .model import predict

    n = int(nbytes)
    if name == "ring" and len(dims) > 1:
        total, share = 0.0, n
        for d in dims:
            if d > 1:
                total += (predict("reduce_scatter", "ring", d, share, params)
                          + predict("allgather", "ring", d, share, params))
                share //= d
        return total
    return sum(predict("allreduce", name, d, n, params) for d in dims if d > 1)


def allreduce_time(nbytes: float, nodes: int, link: Link, algorithm: str = "auto",
                   topology: str = "star", models: str = "paper") -> tuple[float, str]:
    """Predicted time of one allreduce of ``nbytes`` among ``nodes`` nodes.

    Args:
        nbytes: message size in bytes.
        nodes: P.
        link: alpha, beta, gamma of the network (and its calibration profile).
        algorithm: with ``models="paper"``: ``"mst"``, ``"bkt"`` or ``"auto"``
            (the faster of the two); with ``models="library"``: one of
            :data:`LIBRARY_ALLREDUCES` (``"bkt"`` is ``"ring"``) or ``"auto"``
            (the fastest of them).
        topology: ``"star"`` (all nodes one hop apart) or ``"mesh"`` (2-D
            mesh of :func:`mesh_dims`, per-dimension sums).
        models: ``"paper"`` or ``"library"`` (see :data:`MODEL_SETS`).

    Returns:
        (seconds, algorithm used).

    Raises:
        ValueError: unknown algorithm, topology or model set.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if models not in MODEL_SETS:
        raise ValueError(f"models must be one of {MODEL_SETS}, got {models!r}")
    known = LIBRARY_ALLREDUCES + ("bkt",) if models == "library" else tuple(ALLREDUCE_MODELS)
    if algorithm != "auto" and algorithm not in known:
        raise ValueError(f"allreduce must be 'auto' or one of {known} with models={models!r}, got {algorithm!r}")
    if nodes <= 1 or nbytes <= 0:
        return 0.0, "none"
    dims = (nodes,) if topology == "star" else mesh_dims(nodes)
    if models == "library":
        names = LIBRARY_ALLREDUCES if algorithm == "auto" else ("ring" if algorithm == "bkt" else algorithm,)
        params = link.cost_params()
        return min((_library_allreduce(name, nbytes, dims, params), name) for name in names)
    names = tuple(ALLREDUCE_MODELS) if algorithm == "auto" else (algorithm,)
    return min((ALLREDUCE_MODELS[name](nbytes, dims, link), name) for name in names)


# --------------------------------------------------------------------------- step


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
