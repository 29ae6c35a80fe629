"""Test scripts that run as ranks under a launcher (``collectives run``,
torchrun, mpiexec) and print one ``RESULT <json>`` line each: the
environment they start from, and reading their results back."""

from __future__ import annotations

import json
import os

__all__ = ["clean_env", "results"]

#: Variables of the test process's own launch that must not reach the ranks.
_DROP = ("COLLECTIVES_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC",
         "PMI_", "OMPI_")


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def results(stdout: str) -> list[dict]:
    """Every rank's RESULT object (lines of different ranks may interleave)."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find("RESULT ")
    while at >= 0:
        obj, _ = decoder.raw_decode(stdout, at + len("RESULT "))
        found.append(obj)
        at = stdout.find("RESULT ", at + 1)
    return found
