"""``collectives explain``: every candidate's predicted time, the parameters and the choice.

    collectives explain allreduce --bytes 4M -n 8 [--transport shm] [--dtype float32] [--profile PATH]

From Python: ``ModelSelector(transport="shm").explain("allreduce", 4 << 20, 8)``
or :func:`explain` here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

from collectives.registry import COLLECTIVES

from .profile import load_profile
from .selector import Explanation, ModelSelector

__all__ = ["main", "explain", "parse_bytes", "transport_capabilities"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"4M"`` -> 4194304 (K, M, G are powers of 1024)."""
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    if unit not in _UNITS or not digits:
        raise ValueError(f"cannot read a size from {text!r} (examples: 512, 64K, 4M, 1G)")
    return int(float(digits) * _UNITS[unit])


def transport_capabilities(name: str) -> frozenset[str]:
    """The capabilities a transport plugin declares (empty if it cannot be loaded)."""
    from collectives.registry import transport_class

    try:
        return frozenset(transport_class(name).capabilities)
    except Exception:
        return frozenset()


def explain(collective: str, nbytes: int, p: int, dtype: Any = np.float32, transport: str = "shm",
            profile: str | None = None) -> Explanation:
    """Why ``algorithm="auto"`` picks what it picks.

    Args:
        collective: the collective.
        nbytes: message size (the selector's convention).
        p: number of ranks.
        dtype: element type.
        transport: whose profile and capabilities to use.
        profile: a profile file instead of the transport's.

    Returns:
        An :class:`~collectives.cost_models.selector.Explanation` (``.table()`` prints it).
    """
    selector = ModelSelector(load_profile(transport, profile), transport)
    return selector.explain(collective, nbytes, p, dtype, transport_capabilities(transport))


def main(argv: Sequence[str] | None = None) -> int:
    """``collectives explain COLLECTIVE --bytes N -n P [--transport NAME] [--dtype T] [--profile PATH]``."""
    ap = argparse.ArgumentParser(prog="collectives explain",
                                 description="predicted time of every algorithm and the choice")
    ap.add_argument("collective", choices=COLLECTIVES)
    ap.add_argument("--bytes", default="1M", help="message size, e.g. 512, 64K, 4M (default 1M)")
    ap.add_argument("-n", "--nprocs", type=int, default=8, help="number of ranks (default 8)")
    ap.add_argument("--transport", default="shm", help="transport (profile and capabilities; default shm)")
    ap.add_argument("--dtype", default="float32", help="element type (default float32)")
    ap.add_argument("--profile", default=None, help="a calibration profile file")
    ns = ap.parse_args(argv)
    try:
        nbytes = parse_bytes(ns.bytes)
    except ValueError as exc:
        ap.error(str(exc))
    from collectives.ops import BFLOAT16

    dtype = BFLOAT16 if ns.dtype == "bfloat16" else np.dtype(ns.dtype)
    print(explain(ns.collective, nbytes, ns.nprocs, dtype, ns.transport, ns.profile).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
