"""reduce algorithms."""
