"""Sharding rules: views (being written)."""
