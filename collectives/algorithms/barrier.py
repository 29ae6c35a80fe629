"""barrier algorithms."""
