"""Speculative decoding: proposers guess the next tokens, one forward pass verifies them.

``base.py`` holds the contract (Proposer), the registry behind --speculative-method and
the per-request controller; ``ngram.py``, ``suffix.py`` and ``draft.py`` are the
proposers; ``verify.py`` the acceptance rule; ``speculator.py`` what the engine calls
around each step.
"""
