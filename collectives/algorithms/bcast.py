"""bcast algorithms."""
