"""window algorithms."""
