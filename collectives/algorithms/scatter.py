"""scatter algorithms."""
