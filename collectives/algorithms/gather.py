"""gather algorithms."""
