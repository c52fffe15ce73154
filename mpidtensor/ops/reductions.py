"""Sharding rules: reductions (being written)."""
