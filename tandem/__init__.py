"""Tandem: the product's face (CLI, local cluster launcher, bench client)."""
