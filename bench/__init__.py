"""Collective microbenchmarks, OSU / nccl-tests style (installed as ``collectives.bench``).

Run ``collectives bench`` (or ``python -m collectives.bench``; from a
checkout, ``python -m bench``). Without arguments it sweeps every collective
from 8 B to 4 MiB on local shared memory with one rank per core, and prints
one table per collective:

``size(B) count type redop root algorithm mode time(us) min max algbw busbw #wrong``

* size: the per-rank buffer, as nccl-tests counts it (the whole vector of
  allreduce, reduce and bcast; the p blocks of allgather, reduce_scatter,
  alltoall, scatter and gather).
* time: warm-up iterations, a barrier, then timed iterations one by one
  (more iterations for small sizes, at most 256 MiB moved per size, as OSU
  does); each iteration's time is the maximum over ranks, and the table
  shows the median (min and max beside it).
* algbw = size / time; busbw = algbw times nccl-tests' bus factor:
  2(p-1)/p for allreduce, (p-1)/p for allgather, reduce_scatter, alltoall,
  scatter and gather, 1 for bcast and reduce.
* #wrong: after timing, one more call on fresh inputs is compared with
  numpy's result; elements that differ, the maximum over ranks.
* ``auto:NAME``: the algorithm ``auto`` chose at that size.

``--compare mpi,gloo`` runs the same sweep through mpi4py's native
collectives (MPICH, under ``mpiexec``) and torch.distributed on Gloo (under
``collectives run``) in the same command, and adds each one's time and the
ratio ours / theirs (below 1: ours is faster); a peer that is not installed
is skipped with the reason. A summary per collective then sets one line per
size side by side: our time per algorithm, the peers', and the ratio of our
fastest algorithm and of ``auto``.

``--json FILE`` writes the host, platform, transport, versions, options,
the calibration profile of the transport when
``collectives.cost_models.profile.load_profile`` offers one, and every
row; ``schema.json`` documents it and :func:`collectives.bench.report.validate`
checks it. ``--baseline FILE`` prints each row's change against an earlier
run. ``--plot STEM`` draws busbw and time versus size (log axes), a line
per algorithm and peer, as ``STEM.png`` and ``STEM.svg`` (needs matplotlib).

On a small shared machine, timings move between runs, and from one set of
ranks to the next (where the scheduler places them): ``--repeat R`` runs R
interleaved rounds and reports the median of the medians, and ``--isolate``
starts fresh ranks for every (collective, algorithm). ``--alloc`` takes our
buffers from ``comm.alloc`` (shared memory), to be reported apart from the
runs on ordinary numpy buffers.

Modules: :mod:`.cli` (the command), :mod:`.sweep` (one rank's sweep),
:mod:`.peers` (ours, MPI, Gloo behind one runner interface),
:mod:`.report` (tables, JSON, schema check, baseline), :mod:`.plot`.
"""
