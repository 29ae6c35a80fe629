"""alltoall algorithms."""
