"""Attention backends behind a small registry (registry.py names them, base.py defines
them). The package imports nothing itself, so the torch-free registry stays torch-free."""
