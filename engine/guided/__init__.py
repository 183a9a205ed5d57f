"""Constrained decoding inside the engine: the per-step token masks (``masks``, torch).
The constraint's specification, compiler and matcher are core's (core/guided)."""
