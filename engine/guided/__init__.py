"""Constrained decoding (llguidance): what a request asks for (``spec``), grammars
compiled and checked once per distinct constraint (``compiler``), the shortest output
a grammar accepts (``search``), and the per-step token masks (``masks``, torch).

Everything but ``masks`` is torch-free: the router compiles and checks a request's
constraint before queueing it, and every worker does so again.
"""
