"""What the router and the engine share, torch-free: the request's vocabulary.

The tokenizer and chat template, sampling parameters and request limits, the
constraint specification and its compiler front end (llguidance), text assembly and
stop strings, chained block hashes and KV layout arithmetic, and the registry of
pluggable choices. It imports nothing of Tandem, no torch and no proto
(tests/test_structure.py checks both): the router loads it without loading a model.
"""
