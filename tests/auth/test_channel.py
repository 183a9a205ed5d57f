"""Channels to workers: a worker that is not listening yet is retried every 2 s at most
(gRPC's own backoff grows to 120 s: a router started a minute before its workers saw
them 14 s after they served)."""
from __future__ import annotations

import grpc

from auth.grpc_auth import channel

SECRET = b"s" * 32


def test_a_missing_worker_is_retried_every_two_seconds_at_most(monkeypatch) -> None:
    made = []
    monkeypatch.setattr(grpc.aio, "insecure_channel",
                        lambda address, options, interceptors: made.append(dict(options)))
    channel("127.0.0.1:1", SECRET)
    assert made[-1]["grpc.max_reconnect_backoff_ms"] == 2000
    assert made[-1]["grpc.initial_reconnect_backoff_ms"] <= 1000
    channel("127.0.0.1:1", SECRET, options=[("grpc.max_reconnect_backoff_ms", 500),
                                            ("grpc.max_receive_message_length", 1 << 20)])
    assert made[-1]["grpc.max_reconnect_backoff_ms"] == 500  # the caller's own choice stands
    assert made[-1]["grpc.max_receive_message_length"] == 1 << 20
