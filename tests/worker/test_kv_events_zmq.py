"""KV events in vLLM's format (worker/kv_events_zmq.py), read by a subscriber written
from vLLM's documented schema (docs.vllm.ai, examples/online_serving/
kv_events_subscriber.py), not from our publisher's types: a live subscriber that
recovers missed batches by replay, and a late one that reads only the replay, both
rebuild exactly which blocks the engine holds in each tier. A publisher whose queue is
full drops and counts, never blocks."""
from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
import zmq

from core.kv.block_hash import BlockHash
from core.sampling import SamplingParams
from engine.kv_cache.block_pool import KVEventKind
from engine.kv_cache.tiers.events import TierEvent
from tests.engine.test_kv_tiers import FILLERS, PROMPT, _spilled_engine
from worker.kv_events_zmq import EngineEventBridge, ZmqKVEventPublisher


# -- the subscriber's side, from vLLM's documented schema ---------------------------------
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(_Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """Applies batches in sequence order to {medium: set of block hashes}."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[bytes]] = {}
        self.next_seq = 0
        self.batches = 0

    def apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # seen already (replay overlaps the live stream)
        assert seq == self.next_seq, f"gap: want {self.next_seq}, got {seq}"
        for e in DECODE.decode(payload).events:
            if isinstance(e, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(e, BlockStored):
                self.blocks.setdefault(e.medium, set()).update(e.block_hashes)
            else:
                self.blocks.setdefault(e.medium, set()).difference_update(e.block_hashes)
        self.next_seq, self.batches = seq + 1, self.batches + 1

    def replay(self, endpoint: str) -> None:
        """Ask for every batch from next_seq on. A DEALER, not vLLM's example's REQ: a REQ
        socket takes one reply per request, and a replay is a stream of them."""
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        for _ in range(100_000):  # bounded: one frame pair per buffered batch, then the end
            assert dealer.poll(10_000), "no replay answer"
            _, seq_bytes, payload = dealer.recv_multipart()
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            self.apply(int.from_bytes(seq_bytes, "big"), payload)
        dealer.close()

    def read_live(self, sub: zmq.Socket, replay_endpoint: str, until_seq: int) -> None:
        """Batches up to until_seq - 1 from the SUB socket; a gap (the batches sent before
        the subscription took hold, or lost at the high-water mark) from the replay."""
        for _ in range(1000):  # bounded: 1000 x 100 ms
            if self.next_seq >= until_seq:
                return
            if not sub.poll(100):
                self.replay(replay_endpoint)  # nothing came: ask for what is missing
                continue
            _, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                self.replay(replay_endpoint)
            self.apply(seq, payload)
        raise AssertionError(f"batches up to {until_seq} never came (at {self.next_seq})")


def _held(eng) -> dict[str, set[bytes]]:
    tiers = eng.tiers
    tiers.disk.drain()
    return {"GPU": set(eng.kv.pool.cached), "CPU": set(tiers.host.entries),
            "DISK": set(tiers.disk.index)}


def _step_and_publish(eng, bridge: EngineEventBridge) -> None:
    """What the engine thread does (engine/engine_thread.py _iterate), with the worker's
    callbacks (worker/base.py)."""
    while eng.has_unfinished():
        eng.step()
        bridge.on_events(eng.drain_kv_events())
        bridge.on_step(eng)


def test_subscribers_rebuild_every_tiers_block_set_exactly(flat_model_dir, tmp_path) -> None:
    eng = _spilled_engine(flat_model_dir, tmp_path)
    eng.generate([PROMPT], SamplingParams(max_tokens=2))  # blocks the publisher finds
    pub = ZmqKVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", eng.kv.block_size)
    bridge = EngineEventBridge(pub)
    eng.drain_kv_events()  # as the engine thread does every step: the snapshot covers them
    bridge.on_step(eng)  # the first step: what the engine holds now
    endpoint, replay = pub.endpoints
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sub.connect(endpoint)
    live = Subscriber()
    for prompt in FILLERS + [PROMPT]:  # device evictions, host spills, disk writes, a hit
        eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        _step_and_publish(eng, bridge)
        live.read_live(sub, replay, pub.accepted)
    want = _held(eng)  # the disk writer done
    bridge.on_events(eng.drain_kv_events())  # its last writes, as the engine thread drains
    bridge.on_step(eng)
    live.read_live(sub, replay, pub.accepted)
    assert pub.dropped == 0
    assert {m: s for m, s in live.blocks.items() if s} == {m: s for m, s in want.items() if s}
    assert want["GPU"] and want["CPU"] and want["DISK"]  # every tier held something
    late = Subscriber()
    late.replay(replay)  # started after everything: the replay alone rebuilds it
    assert late.blocks == live.blocks and late.batches == live.batches
    pub.close()
    sub.close()
    eng.tiers.disk.close()
    eng.leak_check()


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    gate = threading.Event()

    class Stalled(ZmqKVEventPublisher):
        def _run(self) -> None:  # a publisher thread that cannot keep up
            assert gate.wait(60)
            super()._run()

    pub = Stalled("tcp://127.0.0.1:*", None, 16, max_queue=1)  # the first batch fills it
    event = [TierEvent(KVEventKind.REMOVED, BlockHash(b"\1" * 32), "GPU")]
    assert [pub.publish(event) for _ in range(3)] == [False] * 3
    assert (pub.dropped, pub.accepted) == (3, 1)
    gate.set()
    assert pub.publish(event) or pub.dropped == 4  # the thread drains again
    pub.close()


def test_an_endpoint_that_cannot_be_bound_is_named() -> None:
    with pytest.raises(ValueError, match="cannot bind 'tcp://256.0.0.1:1'"):
        ZmqKVEventPublisher("tcp://256.0.0.1:1", None, 16)


def test_a_replay_endpoint_without_an_endpoint_is_refused() -> None:
    from engine.config import EngineConfig
    from worker.config import WorkerConfig

    with pytest.raises(ValueError, match="--kv-events-replay-endpoint needs --kv-events-endpoint"):
        WorkerConfig(EngineConfig(), kv_events_replay_endpoint="tcp://*:5558")


def test_a_decode_worker_publishes_its_blocks_on_the_flagged_endpoint(tiny_model_dir) -> None:
    import asyncio

    from auth.grpc_auth import channel as auth_channel
    from decode_svc.service import DecodeService
    from proto import decode_pb2_grpc
    from tests.services.conftest import generate, sampling, worker_config

    async def body() -> None:
        config = worker_config(tiny_model_dir)
        d = DecodeService(type(config)(**{**config.__dict__,
                                          "kv_events_endpoint": "tcp://127.0.0.1:*",
                                          "kv_events_replay_endpoint": "tcp://127.0.0.1:*"}))
        await d.start()
        ch = auth_channel(f"127.0.0.1:{d.port}", d.secret)
        try:
            await generate(decode_pb2_grpc.DecodeStub(ch), "r", PROMPT, [], sampling(4))
            held = set(await d.engine.cached_hashes())
            assert len(held) == 4  # the prompt's full blocks (+ decoded ones: none full)
            _, replay = d.kv_events.endpoints
            for _ in range(100):  # bounded: the last step's events may still be on their way
                sub = Subscriber()
                await asyncio.to_thread(sub.replay, replay)
                if sub.blocks.get("GPU") == held:
                    break
                await asyncio.sleep(0.05)
            assert sub.blocks == {"GPU": held}
        finally:
            await ch.close()
            await d.stop(0)

    asyncio.run(asyncio.wait_for(body(), 120))
