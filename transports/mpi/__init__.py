"""MPI transport through mpi4py (the ``mpich`` wheel works; no system MPI needed).

Rank and size come from MPI itself, so ``init(transport="mpi")`` works under
``mpiexec -n 4 python script.py``. Point-to-point uses ``Isend``/``Irecv`` on
buffers (no pickling); every message carries its call's signature.

One module per job:

==============  ==============================================================
``transport``   :class:`MpiTransport`: the communicators, sends and receives,
                the slow path of waits (a peer out of step)
``messages``    the message format: the header, small messages staged whole,
                large ones as a header and then a payload, truncation
``waits``       polling a request against its deadline
``control``     the control communicator: aborts, goodbyes, status queries
``diagnosis``   a timeout's verdict: who has not arrived, where each rank is
``native``      MPI's own collectives and the ranks' agreement on a signature
``errors``      MPI's errors as the library's
``tags``        tags and the calls they belong to
==============  ==============================================================

What mpiexec (MPICH's hydra, MPICH 5.0.2 of the ``mpich`` wheel) does when
a rank ends early, measured on one host:

* The rank leaves Python normally: ``sys.exit`` with status 0 or not, or an
  uncaught exception (status 1). Python's ``atexit`` closes its
  communicators first (an uncaught exception aborts them before that), so
  its peers raise PeerLost within milliseconds; then mpi4py's
  ``MPI_Finalize`` waits until every other rank has called
  ``MPI_Finalize`` too. Hydra sees nothing until then and kills no one;
  mpiexec's exit status is the bitwise OR of the ranks' statuses.
* The rank ends without ``MPI_Finalize``: ``os._exit`` with any status, 0
  included, a crash, or a signal (``SIGKILL``). Hydra kills every other
  rank with ``SIGKILL`` at once (their last sign of life came 2 to 5 ms
  after the death here): they see nothing, raise nothing and report
  nothing; no code of the library runs. For a signal it prints ``BAD
  TERMINATION OF ONE OF YOUR APPLICATION PROCESSES ... EXIT CODE: 9`` and
  mpiexec exits with 9; after ``os._exit(0)`` it kills the others
  silently and exits with 0. With ``mpiexec -disable-auto-cleanup`` a
  rank killed by a signal still took the others with it; after
  ``os._exit(0)`` they ran on (a wait on the dead rank then ends in
  CollectiveTimeout: MPI gives no sign of the death) and then hung in
  ``MPI_Finalize``.
"""

from .messages import HEADER_BYTES, SMALL_BYTES
from .transport import MpiTransport
from .waits import CONFIRM_SECONDS

__all__ = ["MpiTransport", "SMALL_BYTES", "HEADER_BYTES", "CONFIRM_SECONDS"]
