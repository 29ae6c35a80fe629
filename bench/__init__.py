"""Microbenchmarks (installed as ``collectives.bench``; from a checkout: ``python -m bench``)."""
