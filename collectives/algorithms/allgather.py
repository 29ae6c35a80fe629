"""allgather algorithms."""
