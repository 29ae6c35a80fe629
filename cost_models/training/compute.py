"""A node's compute in the training model: GEMMs by the roofline.

Per layer, three GEMMs (:func:`layer_gemms`): forward propagation (FP),
backward gradient computation (BP-GC) and backward weight update (BP-WU);
convolutions go through im2col. A node's time for a GEMM is
``flops / min(peak, bandwidth * intensity)`` (:meth:`Node.gemm_time`), with
the arithmetic intensity of a cache-blocked GEMM (GotoBLAS / BLIS blocks
m_c, n_c, k_c) or of an unblocked one (:meth:`Gemm.intensity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .networks import Layer

__all__ = ["WORD_BYTES", "Blocking", "SKYLAKE_BLOCKING", "Gemm", "layer_gemms", "Node"]

WORD_BYTES = 4  # FP32


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
