"""The states a request's handling reports to the outside, as enums. Torch-free: the
router reads them from the decode workers' traces.

Each member's value is the string clients, dashboards and logs already read (a metric
label, a span attribute, a field of the request log); code compares members, never
those strings. Where a state crosses a process boundary, proto/ has an enum of its own
and proto/convert.py converts, in one place per enum.
"""
from __future__ import annotations

from enum import Enum


class FallbackReason(Enum):
    """Why a decode worker recomputed a prompt instead of pulling its KV (the
    ``reason`` label of tandem:kv_transfer_fallbacks_total, the trace's fallback)."""

    LEASE_EXPIRED = "lease_expired"
    """The source's lease ended before the read could be confirmed."""
    PEER_UNREACHABLE = "peer_unreachable"
    """No link to the source could be made."""
    TRANSFER_FAILED = "transfer_failed"
    """The read failed (or timed out) for another reason."""
    UNKNOWN_PEER = "unknown_peer"
    """The handle names a source no router's discovery lists (nor --kv-peer)."""
    UNAUTHENTICATED_PEER = "unauthenticated_peer"
    """The source could not prove it holds the cluster secret."""


class PreemptionMode(Enum):
    """How a preempted request gave its KV blocks back (the ``mode`` label of
    tandem:num_preemptions_total)."""

    SWAP = "swap"
    """Copied to the host swap pool, copied back when it resumes."""
    RECOMPUTE = "recompute"
    """Freed; the request's context is computed again when it resumes."""
