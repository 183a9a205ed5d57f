"""Moving paged KV blocks between processes: NIXL (UCX), TCP fallback, in-process.

The contract is in ``kvtransfer.base``; backends load lazily through
``get_backend``. Nothing here imports NIXL until the nixl backend is asked for.
"""
from __future__ import annotations

from kvtransfer.base import (KV_LAYOUT, Backend, BackendName, CompatRecord, KVBackendUnavailable,
                             KVCompatError, KVReader, KVSource, KVTransferError, LeaseError,
                             PeerId, ReadHandle, ReadPlan, SourceBlocks, SourceInfo,
                             TransferState, get_backend)
from kvtransfer.lease import Lease, LeaseTable

__all__ = ["KV_LAYOUT", "Backend", "BackendName", "CompatRecord", "KVBackendUnavailable",
           "KVCompatError", "KVReader", "KVSource", "KVTransferError", "Lease", "LeaseError",
           "LeaseTable", "PeerId", "ReadHandle", "ReadPlan", "SourceBlocks", "SourceInfo",
           "TransferState", "get_backend"]
