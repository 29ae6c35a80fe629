"""reduce_scatter algorithms."""
