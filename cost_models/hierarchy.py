"""Cost models of the hierarchical algorithms, and how ``auto`` chooses
between them and the flat ones (installed as ``collectives.cost_models.hierarchy``).

A hierarchical algorithm runs phases within hosts (over shared memory, the
``intra`` parameters: the shm profile) and between hosts (over the job's
transport, the ``inter`` parameters: its profile), so its formula is the
sum of its phases, each priced by the formula of what runs in it:

* ``local(c, n)``: collective c among the L ranks of the largest host,
  through the shared window (:mod:`.window`), with intra parameters;
* ``cross(c, n, s)``: collective c among the H hosts' drivers (the
  algorithm the default rule picks for H ranks), with inter parameters
  whose beta is multiplied by s, the streams that share a host's link at
  once (m slots drive slices together: each gets 1/m of the link);
* ``round(b, s)``: one direct exchange between hosts, each driver sending
  (H-1) messages of a summary plus b bytes, s streams per link:
  (H-1) (alpha + o) + (H-1) (S + b) beta s;
* ``check``: ``local(allgather, L R) + round(0, m)`` (R the record's and S
  the summary's bytes), plus, on uneven hosts, a local bcast of H
  summaries.

The flat candidate (what the flat selector picks) is priced by its own
formula over all p ranks with the inter parameters. That is optimistic
for it: the ranks of a host share their link, which that formula does not
see, so the hierarchical algorithms win more often than predicted.
``auto`` takes the least predicted time (:func:`choose`); every rank
decides alike, from the parameters rank 0 sent every rank at init.

Formulas, with n the selector's size (the p blocks together for scatter,
gather, allgather, reduce_scatter and alltoall), H hosts, L ranks on the
largest, m on the smallest, p in all, u = 1 on uneven hosts:

==================  =========================================================
allreduce           check + local(rs, n) + cross(allreduce, n/m, m) + local(ag, n)
bcast               check + local(bcast, n) + cross(bcast, n/m, m) + local(ag, n)
reduce              check + local(rs, n) + cross(reduce, n/m, m) + local(gather, n)
reduce_scatter      check + copy(n) + local(rs, n) + cross(rs, n/m, m) + u m local(scatter, nL/p)
allgather           check + u m local(gather, nL/p) + cross(ag, n/m, m) + local(ag, n) + copy(n)
gather              check + local(gather, nL/p) + cross(gather, n, 1)
scatter             check + cross(scatter, n, 1) + local(scatter, nL/p)
alltoall            check + 3 copy(n) + local(alltoall, n) + cross(alltoall, n, m)
                    (uneven: local(gather, Ln) + cross(alltoall, Ln, 1) + local(scatter, Ln))
barrier             check
one round (each)    local(allgather, L R) [+ local(allgather, L b) above the inline size]
                    + reductions + round(b_host, m) + u local(bcast, H (S + b_host))
==================  =========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from collectives.hierarchy.checks import INLINE_BYTES, RECORD_WORDS, SUMMARY_WORDS

from .model import Params, predict

__all__ = ["HierParams", "Shape", "HIER_MODELS", "hier_model", "predict_hier", "Candidate", "HierExplanation",
           "explain_hier", "choose", "load_params"]

#: Bytes of a rank's record and of a host's summary (see collectives.hierarchy.checks).
RECORD_BYTES = 8 * RECORD_WORDS
SUMMARY_BYTES = 8 * SUMMARY_WORDS


@dataclass(frozen=True)
class HierParams:
    """Parameters within a host (``intra``) and between hosts (``inter``)."""

    intra: Params
    inter: Params

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, without the anchors and stretch tables (rank 0 sends it to every rank at init)."""
        def small(P: Params) -> dict:
            d = P.as_dict()
            d.pop("anchors", None)
            d.pop("stretch", None)
            return d
        return {"intra": small(self.intra), "inter": small(self.inter)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HierParams":
        return cls(Params.from_dict(d["intra"]), Params.from_dict(d["inter"]))


def load_params(inter_transport: str, intra_profile: str | None = None,
                inter_profile: str | None = None) -> HierParams:
    """The shm profile within hosts and ``inter_transport``'s between them (defaults where none)."""
    from .profile import load_profile

    return HierParams(load_profile("shm", intra_profile), load_profile(inter_transport, inter_profile))


@dataclass(frozen=True)
class Shape:
    """Ranks per host, in node order."""

    sizes: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """``2x4`` (2 hosts of 4), ``2+1`` or ``2,1`` (hosts of 2 and 1)."""
        t = text.strip().lower()
        try:
            if "x" in t:
                hosts, per = t.split("x")
                sizes = (int(per),) * int(hosts)
            else:
                sizes = tuple(int(x) for x in t.replace("+", ",").split(",") if x)
        except ValueError:
            raise ValueError(f"cannot read hosts from {text!r} (examples: 2x4, 2+1, 4,4,2)") from None
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cannot read hosts from {text!r}: every host needs a rank")
        return cls(sizes)

    @property
    def H(self) -> int:
        return len(self.sizes)

    @property
    def L(self) -> int:
        return max(self.sizes)

    @property
    def m(self) -> int:
        return min(self.sizes)

    @property
    def p(self) -> int:
        return sum(self.sizes)

    @property
    def uneven(self) -> bool:
        return self.L != self.m

    def __str__(self) -> str:
        return f"{self.H}x{self.L}" if not self.uneven else "+".join(map(str, self.sizes))


HierModel = Callable[[Shape, float, HierParams, Any], float]
HIER_MODELS: dict[tuple[str, str], tuple[HierModel, str]] = {}


def hier_model(collective: str, name: str, summary: str) -> Callable[[HierModel], HierModel]:
    """Decorator: register ``func(shape, n, hp, dtype)`` as the formula of hierarchical (collective, name)."""
    def deco(func: HierModel) -> HierModel:
        HIER_MODELS[(collective, name)] = (func, summary)
        return func
    return deco


# ------------------------------------------------------------------ terms


def local(c: str, s: Shape, n: float, hp: HierParams, dtype: Any) -> float:
    """Collective ``c`` among the largest host's ranks through the shared window."""
    return 0.0 if s.L == 1 else predict(c, "shared_window", s.L, int(n), hp.intra, dtype)


def cross(c: str, s: Shape, n: float, streams: int, hp: HierParams, dtype: Any) -> float:
    """Collective ``c`` among H drivers, ``streams`` of them sharing a host's link."""
    if s.H == 1:
        return 0.0
    from collectives.selection import rule

    itemsize = np.dtype(dtype).itemsize
    name = rule(c, int(n), s.H, itemsize, frozenset())
    return predict(c, name, s.H, int(n), replace(hp.inter, beta=hp.inter.beta * streams), dtype)


def round_(s: Shape, b: float, streams: int, hp: HierParams) -> float:
    """One direct exchange between hosts of a summary and ``b`` bytes per host."""
    P = hp.inter
    k = s.H - 1
    return k * (P.alpha + P.overhead) + k * (SUMMARY_BYTES + b) * P.beta * streams if k else 0.0


def check(s: Shape, hp: HierParams, dtype: Any = np.uint8) -> float:
    """The check every hierarchical call starts with."""
    t = local("allgather", s, s.L * RECORD_BYTES, hp, np.uint64) + round_(s, 0, s.m, hp)
    return t + (local("bcast", s, s.H * SUMMARY_BYTES, hp, np.uint64) if s.uneven else 0.0)


def copy(n: float, hp: HierParams) -> float:
    return hp.intra.copy(n)


def _gamma(hp: HierParams, dtype: Any) -> float:
    return hp.intra.for_dtype(dtype).gamma


def one_round(s: Shape, payload: float, host_bytes: float, reduce_bytes: float, hp: HierParams,
              dtype: Any) -> float:
    """A one-round algorithm: ``payload`` bytes per rank gathered within hosts,
    ``host_bytes`` per host exchanged, ``reduce_bytes`` reduced per host and per rank."""
    t = local("allgather", s, s.L * RECORD_BYTES, hp, np.uint64)
    if payload > INLINE_BYTES:
        t += local("allgather", s, s.L * payload, hp, dtype)
    t += reduce_bytes * (s.L - 1 + s.H - 1) * _gamma(hp, dtype)
    t += round_(s, host_bytes, s.m, hp)
    if s.uneven:
        t += local("bcast", s, s.H * (SUMMARY_BYTES + host_bytes), hp, np.uint8)
    return t


# ------------------------------------------------------------------ formulas


def _sliced() -> None:
    @hier_model("allreduce", "hierarchical", "check + local rs + cross allreduce of n/m on m slots + local ag")
    def allreduce(s, n, hp, dt):
        return (check(s, hp) + local("reduce_scatter", s, n, hp, dt) + cross("allreduce", s, n / s.m, s.m, hp, dt)
                + local("allgather", s, n, hp, dt))

    @hier_model("bcast", "hierarchical", "check + local bcast on the root's host + cross bcast of n/m + local ag")
    def bcast(s, n, hp, dt):
        return (check(s, hp) + local("bcast", s, n, hp, dt) + cross("bcast", s, n / s.m, s.m, hp, dt)
                + local("allgather", s, n, hp, dt))

    @hier_model("reduce", "hierarchical", "check + local rs + cross reduce of n/m + local gather on the root's host")
    def reduce(s, n, hp, dt):
        return (check(s, hp) + local("reduce_scatter", s, n, hp, dt) + cross("reduce", s, n / s.m, s.m, hp, dt)
                + local("gather", s, n, hp, dt))

    @hier_model("reduce_scatter", "hierarchical", "check + copy + local rs + cross rs of n/m (+ local scatters)")
    def reduce_scatter(s, n, hp, dt):
        t = check(s, hp) + copy(n, hp) + local("reduce_scatter", s, n, hp, dt)
        t += cross("reduce_scatter", s, n / s.m, s.m, hp, dt)
        return t + (s.m * local("scatter", s, n * s.L / s.p, hp, dt) if s.uneven else 0.0)

    @hier_model("allgather", "hierarchical", "check (+ local gathers) + cross ag of n/m + local ag + copy")
    def allgather(s, n, hp, dt):
        t = check(s, hp) + (s.m * local("gather", s, n * s.L / s.p, hp, dt) if s.uneven else 0.0)
        return t + cross("allgather", s, n / s.m, s.m, hp, dt) + local("allgather", s, n, hp, dt) + copy(n, hp)

    @hier_model("gather", "hierarchical", "check + local gather to each host's leader + cross gather")
    def gather(s, n, hp, dt):
        return check(s, hp) + local("gather", s, n * s.L / s.p, hp, dt) + cross("gather", s, n, 1, hp, dt)

    @hier_model("scatter", "hierarchical", "check + cross scatter to each host's leader + local scatter")
    def scatter(s, n, hp, dt):
        return check(s, hp) + cross("scatter", s, n, 1, hp, dt) + local("scatter", s, n * s.L / s.p, hp, dt)

    @hier_model("alltoall", "hierarchical", "check + local alltoall + cross alltoall on m slots + copies")
    def alltoall(s, n, hp, dt):
        if s.uneven:
            return (check(s, hp) + 2 * copy(s.L * n, hp) + local("gather", s, s.L * n, hp, dt)
                    + cross("alltoall", s, s.L * n, 1, hp, dt) + local("scatter", s, s.L * n, hp, dt))
        return (check(s, hp) + 3 * copy(n, hp) + local("alltoall", s, n, hp, dt)
                + cross("alltoall", s, n, s.m, hp, dt))

    @hier_model("barrier", "hierarchical", "the check alone (local allgather + one round between hosts)")
    def barrier(s, n, hp, dt):
        return check(s, hp)


def _one_round() -> None:
    name = "hierarchical_one_round"

    @hier_model("allreduce", name, "local allgather + host sums, one round of host sums between hosts")
    def allreduce(s, n, hp, dt):
        return one_round(s, n, n, n, hp, dt)

    @hier_model("reduce", name, "local allgather + host sums, one round of host sums between hosts")
    def reduce(s, n, hp, dt):
        return one_round(s, n, n, n, hp, dt)

    @hier_model("reduce_scatter", name, "local allgather + host sums, one round of host sums between hosts")
    def reduce_scatter(s, n, hp, dt):
        return one_round(s, n, n, n, hp, dt)

    @hier_model("bcast", name, "the root's data inline, one round from the root's host")
    def bcast(s, n, hp, dt):
        return one_round(s, n, n, 0, hp, dt)

    @hier_model("scatter", name, "the root's data inline, one round from the root's host")
    def scatter(s, n, hp, dt):
        return one_round(s, n, n, 0, hp, dt)

    @hier_model("allgather", name, "local allgather, one round of host blocks between hosts")
    def allgather(s, n, hp, dt):
        return one_round(s, n / s.p, n * s.L / s.p, 0, hp, dt) + copy(n, hp)

    @hier_model("gather", name, "local allgather, one round of host blocks between hosts")
    def gather(s, n, hp, dt):
        return one_round(s, n / s.p, n * s.L / s.p, 0, hp, dt) + copy(n, hp)

    @hier_model("alltoall", name, "local allgather of every sendbuf, one round of host sendbufs")
    def alltoall(s, n, hp, dt):
        return one_round(s, n, s.L * n, 0, hp, dt) + copy(n, hp)


_sliced()
_one_round()


def predict_hier(collective: str, name: str, shape: Shape, nbytes: int, hp: HierParams,
                 dtype: Any = np.float32) -> float:
    """Predicted seconds of hierarchical algorithm ``name`` of ``collective`` on ``shape``."""
    func, _ = HIER_MODELS[(collective, name)]
    itemsize = np.dtype(dtype).itemsize
    return float(func(shape, float(int(nbytes) - int(nbytes) % itemsize), hp, dtype))


@dataclass(frozen=True)
class Candidate:
    """One algorithm's prediction: ``kind`` is ``flat`` or ``hierarchical``."""

    name: str
    seconds: float
    kind: str
    formula: str


@dataclass(frozen=True)
class HierExplanation:
    """Why ``auto`` picks what it picks on a hierarchical communicator."""

    collective: str
    nbytes: int
    shape: Shape
    dtype: str
    params: HierParams
    candidates: list[Candidate]
    choice: str
    hosts: str = ""  # inside a job: every host, its ranks and cores (Topology.describe())

    def table(self) -> str:
        """Printable: the topology, the parameters, every candidate and the choice."""
        s, hp = self.shape, self.params

        def line(P: Params) -> str:
            return (f"a message {P.messages()}, "
                    f"gamma={P.gamma * 1e9:.4f} ns/B, fence={P.fence * 1e6:.2f} us ({P.source})")
        lines = [f"{self.collective}: {self.nbytes} bytes, {s.p} ranks on {s.H} hosts ({s}), {self.dtype}",
                 f"topology: hosts of {', '.join(map(str, s.sizes))} ranks; {s.m} local rank(s) per host drive "
                 f"slices across hosts" + ("; uneven hosts: the others go through them" if s.uneven else ""),
                 *([self.hosts] if self.hosts else []),
                 f"within a host (shm): {line(hp.intra)}", f"between hosts: {line(hp.inter)}",
                 f"{'algorithm':34s} {'kind':>12s} {'predicted':>14s}  formula"]
        for c in self.candidates:
            mark = "*" if c.name == self.choice else " "
            lines.append(f"{mark}{c.name:33s} {c.kind:>12s} {c.seconds * 1e6:11.2f} us  {c.formula}")
        lines.append(f"choice: {self.choice}")
        return "\n".join(lines)


def explain_hier(collective: str, nbytes: int, shape: Shape, hp: HierParams, flat: list[str],
                 dtype: Any = np.float32) -> HierExplanation:
    """Every candidate of ``collective`` at ``nbytes`` on ``shape``: the flat ones
    named in ``flat`` (their own formulas over all ranks, inter parameters) and every hierarchical one."""
    from . import MODELS, _load

    _load()
    dt = np.dtype(dtype)
    cands = []
    for name in flat:
        model = MODELS.get((collective, name))
        if model is not None:
            cands.append(Candidate(name, predict(collective, name, shape.p, nbytes, hp.inter, dt), "flat",
                                   model.summary))
    for (c, name), (_, summary) in HIER_MODELS.items():
        if c == collective:
            cands.append(Candidate(name, predict_hier(c, name, shape, nbytes, hp, dt), "hierarchical", summary))
    cands.sort(key=lambda c: c.seconds)
    return HierExplanation(collective, int(nbytes), shape, dt.name, hp, cands, cands[0].name)


def choose(collective: str, nbytes: int, shape: Shape, hp: HierParams, flat: str, dtype: Any = np.float32) -> str:
    """``flat`` or the hierarchical algorithm predicted fastest, whichever is faster."""
    return explain_hier(collective, nbytes, shape, hp, [flat], dtype).choice
