"""The seeded mismatch campaign (``python -m collectives.bench.mismatch_fuzz``
runs 10,000 trials): a few hundred trials here, on shared memory, on fresh
calls and against kept calls (prepared, and from C)."""

from __future__ import annotations

import pytest

from collectives.bench.mismatch_fuzz import fuzz, tally
from harness import run_ranks


@pytest.mark.parametrize("p,seed,trials,kept", [(2, 11, 500, 0), (3, 12, 250, 0), (2, 13, 250, 3), (3, 14, 150, 3)])
def test_random_mismatched_calls_never_pass_silently(p, seed, trials, kept):
    result = tally(run_ranks(fuzz, p, seed, 0, trials, 5.0, kept, timeout=300, comm_timeout=60))
    counts = result["counts"]
    assert counts["trials"] == trials
    assert counts["silent"] == 0 and counts["outside"] == 0 and counts["hung"] == 0, result["bad"][:5]
    assert counts["changed"] == 0, result["bad"][:5]  # (caught on the shared window: no buffer changed)
    assert counts["agreed"] > trials // 8 and counts["caught"] > trials // (4 if kept else 2), counts
    assert not kept or counts["from_c"] > trials // 16, counts  # mismatches met calls from C
