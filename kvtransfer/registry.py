"""The names behind --kv-transfer (torch-free; the worker config validates against it,
so `tandem --help` and start-up errors do not wait for torch)."""
from __future__ import annotations

from core.registry import Registry

KV_BACKENDS: Registry = Registry(  # entries: kvtransfer.base.Backend instances
    "KV transfer backend", "--kv-transfer",
    {"nixl": "kvtransfer.nixl:BACKEND", "tcp": "kvtransfer.tcp:BACKEND",
     "local": "kvtransfer.local:BACKEND"},
    hints={"nixl": "pip install nixl-cu12, or pass --kv-transfer tcp to use the TCP fallback"})
"""Every KV transfer backend; each module exports its ``BACKEND``."""
