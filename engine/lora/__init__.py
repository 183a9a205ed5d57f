"""Multi-LoRA: PEFT adapters read from disk (adapter.py), their stacked slots on every
targeted linear and the batched low-rank products (layers.py), the adapters resident in
one model (slots.py) and the adapters served by name (registry.py)."""
