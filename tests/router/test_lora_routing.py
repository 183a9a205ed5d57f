"""Router placement of LoRA requests against fake workers: only a worker that serves
the adapter takes it, the prompt is hashed with the adapter's identity as the workers
hash it (core/kv lora_salt), so the worker holding the adapter's blocks wins, the
adapter's name goes to the worker, and a prefill worker holding other files under
that name is never paired with the decode worker (its KV would be refused)."""
from __future__ import annotations

import asyncio
import time

from core.kv import hash_token_blocks, lora_salt
from core.sampling import SamplingParams
from proto import common_pb2
from router.config import RouterConfig
from router.flow import RequestFlow
from router.trace import RequestPath, Trace
from router.workers import Worker
from tests.router.test_flow import FakeDecode, FakePool, FakePrefill, Tok

IDENTITY, OTHER = b"\x11" * 32, b"\x22" * 32


class NamingDecode(FakeDecode):
    def __init__(self) -> None:
        super().__init__(None)
        self.loras: list[str] = []

    def Generate(self, req, timeout):
        self.loras.append(req.lora_name)
        return super().Generate(req, timeout)


def _serving(w: Worker, identity: bytes | None) -> Worker:
    loads = common_pb2.WorkerLoad(lora_generation=1)
    if identity is not None:
        loads.loras.add(name="x", path="/adapters/x", identity=identity)
    w.take_loras(loads)
    return w


def test_an_adapter_request_goes_where_the_adapters_blocks_are_and_never_elsewhere() -> None:
    async def body():
        prompt = list(range(40))  # 2 full blocks of 16
        prefill = FakePrefill()
        lacking, idle, holder = NamingDecode(), NamingDecode(), NamingDecode()
        workers = [_serving(Worker("127.0.0.1:9300", "prefill", None, prefill, healthy=True), OTHER),
                   _serving(Worker("127.0.0.1:9301", "decode", None, lacking, healthy=True), None),
                   _serving(Worker("127.0.0.1:9302", "decode", None, idle, healthy=True), IDENTITY),
                   _serving(Worker("127.0.0.1:9303", "decode", None, holder, healthy=True), IDENTITY)]
        cfg = RouterConfig(local_prefill_threshold=0)
        flow = RequestFlow(cfg, Tok(), FakePool(workers))
        salted = hash_token_blocks(prompt, cfg.block_size, cfg.hash_seed,
                                   salt=lora_salt(b"", IDENTITY))
        for h in salted:  # the holder's KV events: blocks cached under adapter x
            flow.pool.index.stored(workers[3].address, h)
        for h in hash_token_blocks(prompt, cfg.block_size, cfg.hash_seed):
            flow.pool.index.stored(workers[1].address, h)  # the base model's blocks
        trace = Trace("rid")
        out = [d async for d in flow.run(prompt, SamplingParams(max_tokens=2), 0, "rid",
                                         trace=trace, deadline=time.monotonic() + 10,
                                         lora="x")]
        assert out[-1].finished and (trace.lora, trace.predicted_cached_tokens) == ("x", 32)
        assert (lacking.loras, idle.loras, holder.loras) == ([], [], ["x"])
        # the prefill worker's "x" is other files: the decode worker prefilled locally
        assert trace.path is RequestPath.LOCAL_PREFILL and prefill.salts == []
        base = [d async for d in flow.run(prompt, SamplingParams(max_tokens=2), 0, "rid2",
                                          deadline=time.monotonic() + 10)]
        assert base[-1].finished and lacking.loras == [""]  # the base blocks' holder
    asyncio.run(body())


def test_an_older_report_does_not_undo_a_newer_adapter_list() -> None:
    w = _serving(Worker("127.0.0.1:9400", "decode", None, None), IDENTITY)
    w.take_loras(common_pb2.WorkerLoad(lora_generation=0))  # sent before the load
    assert w.lora_identity("x") == IDENTITY and w.lora_identity("") == b""
    w.take_loras(common_pb2.WorkerLoad(lora_generation=0), fresh=True)  # a restarted worker
    assert w.lora_identity("x") is None
