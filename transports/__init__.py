"""Transport plugins (installed as ``collectives.transports``).

Each module holds one transport: ``shm`` (shared memory, the default on one
host), ``zmq`` (ZeroMQ over TCP), ``mpi`` (mpi4py), ``sim`` (virtual clock).
They are registered through the ``collectives.transports`` entry-point group.
"""
