"""allreduce algorithms."""
