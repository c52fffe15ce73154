"""Sharding rules: matrix (being written)."""
