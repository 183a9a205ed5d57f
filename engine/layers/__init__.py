"""What model families share: linears that know their checkpoint shards and their
tensor-parallel split, norms, gated activations, rotary embeddings with the scalings
checkpoints use, and the attention layer with its per-layer parameters. A family file
(engine/models/) only says how these connect."""
