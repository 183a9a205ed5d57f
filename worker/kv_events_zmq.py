"""KV events in vLLM's format on a ZMQ PUB socket, for KV-aware routers built for vLLM
(llm-d, Dynamo): which blocks a worker holds, and in which tier.

The wire format is that of vLLM's documented subscriber (vllm.distributed.kv_events,
examples/online_serving/kv_events_subscriber.py): each message is three frames, the
topic, an 8-byte big-endian sequence number and a msgpack ``KVEventBatch`` (structs
encoded as arrays, events tagged with their class name):

    KVEventBatch = [ts: float, events: [event, ...]]
    BlockStored  = ["BlockStored", block_hashes, parent_block_hash, token_ids,
                    block_size, lora_id, medium]
    BlockRemoved = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

A block hash is Tandem's 32-byte chained hash (core/kv/block_hash.py: seeded and salted
by tenant), sent as bytes, one block per event; ``parent_block_hash`` and ``lora_id``
are None (a tier does not know a block's parent, and Tandem has no LoRA ids). The medium
is "GPU" for the engine's device pool, "CPU" for the host tier, "DISK" for the disk tier
(engine/kv_cache/tiers/events.py). The first batch is AllBlocksCleared, the next
stores every block held when the engine started (a restarted worker's disk blocks).

A replay socket (ROUTER) answers a subscriber that starts late or missed batches: it
sends a start sequence number (8 bytes big-endian) and gets every buffered batch from
there as (sequence, payload) frames, then (-1, empty). ``publish`` never blocks the
engine thread: batches wait in a bounded queue for the publisher thread, and one that
finds the queue full is dropped and counted (``dropped``); a subscriber that does not
read loses messages at the PUB socket's high-water mark, never holds up the engine.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import msgspec
import zmq

from engine.kv_cache.block_pool import KVEventKind
from engine.kv_cache.tiers.events import TierEvent

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


def to_vllm(events: Sequence[TierEvent], block_size: int) -> list[KVCacheEvent]:
    return [BlockStored([e.block_hash], None, list(e.tokens), block_size, None, e.medium)
            if e.kind is KVEventKind.STORED else BlockRemoved([e.block_hash], e.medium)
            for e in events]


class ZmqKVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int,
                 topic: str = "kv-events", buffer_batches: int = 10_000, max_queue: int = 1024,
                 hwm: int = 100_000) -> None:
        """Binds both sockets now (ValueError naming the endpoint when it cannot)."""
        self.block_size = block_size
        self.dropped = 0
        """Batches dropped because the queue was full."""
        self.accepted = 1
        """Batches queued (the first, AllBlocksCleared, included): the sequence numbers
        0 .. accepted - 1 go out in order."""
        self._topic = topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint, hwm)
        self._replay = self._bind(zmq.ROUTER, replay_endpoint, hwm) if replay_endpoint else None
        self._queue: queue.Queue[list[KVCacheEvent] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue.put([AllBlocksCleared()])  # a subscriber forgets this worker's past
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.set_hwm(hwm)
        sock.linger = 0
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise ValueError(f"KV events: cannot bind {endpoint!r}: {e}") from e
        return sock

    @property
    def endpoints(self) -> tuple[str, str | None]:
        """The bound (PUB, replay) endpoints, ports resolved (tcp://host:* binds any)."""
        last = zmq.LAST_ENDPOINT
        return (self._pub.getsockopt_string(last),
                self._replay.getsockopt_string(last) if self._replay else None)

    def publish(self, events: Sequence[TierEvent]) -> bool:
        """Queue one batch (engine thread; never blocks); False when it was dropped."""
        if not events:
            return True
        try:
            self._queue.put_nowait(to_vllm(events, self.block_size))
        except queue.Full:
            self.dropped += 1
            return False
        self.accepted += 1
        return True

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = encoder.encode(EventBatch(time.time(), events))
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


class EngineEventBridge:
    """Feeds a publisher from the engine thread (EngineWorker's on_events and on_step):
    every tier's events (LLMEngine.drain_kv_events), one batch per step. The first step
    publishes everything held then instead (a restarted worker's disk blocks)."""

    def __init__(self, publisher: ZmqKVEventPublisher) -> None:
        self.publisher = publisher
        self._pending: list[TierEvent] = []
        self._started = False

    def on_events(self, events: list[TierEvent]) -> None:
        self._pending += events

    def on_step(self, engine: LLMEngine) -> None:
        if not self._started:  # what is held now covers the events so far
            self._started = True
            self._pending.clear()
            self.publisher.publish(engine.stored_blocks())
            return
        events, self._pending = self._pending, []
        self.publisher.publish(events)
