"""Device-memory plugins (installed as ``collectives.devices``).

A device plugin is not a transport: it stages an array that lives in device
memory through host memory, so that any transport can carry it. Each module
holds one: ``cuda`` (libcudart through cffi). They are registered through
the ``collectives.devices`` entry-point group, whose entries name
``stage(buf, writable) -> (host_array, finish)``; ``finish(commit)`` copies
the result back (``True``) or not (``False``, a failed call) and frees the
host copy.
"""
