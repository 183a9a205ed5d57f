"""Constrained decoding's front end (llguidance): what a request asks for (``spec``),
grammars compiled and checked once per distinct constraint (``compiler``, built first
in a child process under ``budget``'s limits: ``probe``), the matcher that accepts
tokens (``acceptor``) and the shortest output a grammar accepts (``search``).

The router compiles and checks a request's constraint before queueing it, and every
worker does so again; the per-step token masks are the engine's (engine/guided/masks.py).
"""
