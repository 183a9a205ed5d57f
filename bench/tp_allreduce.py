"""The share of a step spent in the model's collectives at --tensor-parallel-size 2 on
this machine: two gloo ranks (this process is rank 0, one rank process beside it, each
with half the cores), fp32, eager.

For a decode step at batch 1 and at batch 8, and for one prefill step of a 256-token
prompt, it prints rank 0's wall time of the engine step (scheduling, the plan sent to
the other rank, the forward, sampling) and its time inside the layers' all-reduces and
the logits' all-gather (engine/parallel/collectives.py, timed only here), medians over
the steps measured. A collective's time on rank 0 includes any wait for rank 1 to reach
it. Bytes: what rank 0 hands the collectives per step (an all-gather's local shard).

The embedded SmolLM2-135M cannot run at TP 2 (9 query heads), so by default the model is
a seeded random Llama of its shapes with the heads cut 12 x 48 (4 KV heads) instead of
9 x 64 (3 KV heads): the same hidden size (576: the same all-reduce bytes), projection
widths, KV bytes per token, MLP (1536), 30 layers and 49152-entry vocabulary (tied).
--model runs another checkpoint whose heads 2 divides. --tp1 adds the same steps at
TP 1 (one process, every core) for comparison. Last, the floor: one bare gloo
all-reduce of the same [rows, hidden] between two otherwise idle processes.

--moe makes the default model a mixture of experts of the same attention: a random
Mixtral with 8 experts of width 768, top 2 (the same active MLP width per token as the
dense 1536), and runs TP 2 twice: each expert split by width (the default) and split
by experts (--enable-expert-parallel), each row with the routed (token, expert) pairs
the busier rank's experts got against the average (1.00: even; under expert
parallelism the busier rank sets the pace: the mean over layer calls). Random routers
route near evenly over many tokens; a trained model's do not, which this cannot show.

    python bench/tp_allreduce.py [--model DIR] [--decode-steps 16] [--prefills 3] [--tp1]
        [--moe]
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from core.sampling import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.parallel.collectives import CollectiveTimer, timing_collectives  # noqa: E402

SMOLLM2_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
    rope_theta=100000.0, initializer_range=0.02, max_position_embeddings=2048)
"""SmolLM2-135M's config with the heads cut 12 x 48 / 4 KV (2 divides them)."""
MOE_SHAPES = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=768)
"""--moe: 8 experts of 768, top 2 (1536 active per token, as the dense MLP)."""
DECODE_PROMPT = 32
PREFILL_TOKENS = 256


@dataclass
class Row:
    kind: str
    rows: int
    """Tokens the step's forward runs (decode: one per sequence)."""
    step_ms: float
    coll_ms: float
    share: float
    calls: int
    bytes: int
    imbalance: float | None = None
    """MoE: the busier rank's routed pairs over the mean (under expert parallelism)."""


def build_model(root: Path, layers: int, moe: bool = False) -> Path:
    """The SmolLM2-shaped random Llama, or with --moe Mixtral (HF safetensors, fp32, a
    byte-level tokenizer padded to the vocabulary)."""
    from tests.models.families import build_checkpoint
    from tests.utils import _byte_level_tokenizer_json

    shapes = {**SMOLLM2_SHAPES, "num_hidden_layers": layers, **(MOE_SHAPES if moe else {})}
    path = build_checkpoint(root, "mixtral" if moe else "llama", **shapes)
    (path / "tokenizer.json").write_text(json.dumps(_byte_level_tokenizer_json(shapes["vocab_size"])))
    return path


def prompt(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


class Routing:
    """From rank 0's (replicated) routers, for each MoE layer call: the (token, expert)
    pairs the busier half of the experts got over the mean of the two halves (what each
    rank runs under expert parallelism; the all-reduce after the layer waits for the
    busier one)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from engine.layers.moe import SparseMoE

        self.ratios: list[float] = []
        for m in model.modules():
            if isinstance(m, SparseMoE):
                m.gate.register_forward_hook(self._count(m.top_k, m.experts.num_experts))

    def _count(self, k: int, experts: int):
        def hook(module, args, logits):
            ids = logits.float().topk(k, dim=-1).indices.flatten()
            upper = int((ids >= experts // 2).sum())
            self.ratios.append(max(upper, ids.numel() - upper) / (ids.numel() / 2))
        return hook

    def take(self) -> float | None:
        """The mean over the layer calls since the last take (None: no MoE)."""
        out = statistics.mean(self.ratios) if self.ratios else None
        self.ratios = []
        return out


def timed_step(eng: LLMEngine, timer: CollectiveTimer, routing: Routing
               ) -> tuple[float, CollectiveTimer, float | None]:
    timer.reset()
    routing.take()
    start = time.perf_counter()
    eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start, CollectiveTimer(timer.calls, timer.seconds, timer.bytes),
            routing.take())


def summarize(kind: str, rows: int,
              samples: list[tuple[float, CollectiveTimer, float | None]]) -> Row:
    step = statistics.median(s for s, _, _ in samples)
    coll = statistics.median(c.seconds for _, c, _ in samples)
    share = statistics.median(c.seconds / s for s, c, _ in samples)
    ratios = [r for _, _, r in samples if r is not None]
    last = samples[-1][1]
    return Row(kind, rows, step * 1e3, coll * 1e3, share * 100, last.calls, last.bytes,
               statistics.mean(ratios) if ratios else None)


def decode_rows(eng: LLMEngine, timer: CollectiveTimer, routing: Routing, batch: int,
                steps: int, g: torch.Generator) -> Row:
    """``steps`` decode steps of ``batch`` sequences, once every one has its first token."""
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(prompt(DECODE_PROMPT, vocab, g), params) for _ in range(batch)]
    while any(not eng.requests[i].output_token_ids for i in ids):
        eng.step()
    samples = [timed_step(eng, timer, routing) for _ in range(steps)]
    while eng.has_unfinished():
        eng.step()
    return summarize(f"decode b{batch}", batch, samples)


def prefill_rows(eng: LLMEngine, timer: CollectiveTimer, routing: Routing, count: int,
                 g: torch.Generator) -> Row:
    """``count`` steps that each prefill one fresh PREFILL_TOKENS-token prompt whole."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    samples = []
    for _ in range(count):
        eng.add_request(prompt(PREFILL_TOKENS, eng.model_config.vocab_size, g), params)
        samples.append(timed_step(eng, timer, routing))
        while eng.has_unfinished():
            eng.step()
    return summarize(f"prefill {PREFILL_TOKENS}", PREFILL_TOKENS, samples)


def measure(path: Path, tp: int, decode_steps: int, prefills: int,
            device: str = "cpu", expert_parallel: bool = False) -> list[Row]:
    """The rows at TP ``tp`` on ``device`` (cuda: NCCL, one GPU per rank; the timer then
    synchronizes around each collective, bench/gpu_check.py's TP section)."""
    eng = LLMEngine(EngineConfig.from_flat(
        model=str(path), dtype="float32", quantization="none", compile=False, device=device,
        tensor_parallel_size=tp, max_model_len=1024, num_kv_blocks=512, block_size=16,
        attention_backend="sdpa", enable_prefix_caching=False, max_num_batched_tokens=512,
        enable_expert_parallel=expert_parallel))
    g = torch.Generator().manual_seed(0)
    routing = Routing(eng.runner.model)
    try:
        with timing_collectives() as timer:
            eng.generate([prompt(16, eng.model_config.vocab_size, g)],  # warm-up
                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            rows = [decode_rows(eng, timer, routing, b, decode_steps, g) for b in (1, 8)]
            rows.append(prefill_rows(eng, timer, routing, prefills, g))
        eng.leak_check()
        return rows
    finally:
        eng.close()


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    moe = any(r.imbalance is not None for r in rows)
    print(f"{'step':<12} {'rows':>5} {'step ms':>8} {'coll ms':>8} {'share %':>8} "
          f"{'colls/step':>10} {'bytes/step':>11}" + (f" {'busier/mean':>11}" if moe else ""))
    for r in rows:
        print(f"{r.kind:<12} {r.rows:>5} {r.step_ms:>8.2f} {r.coll_ms:>8.2f} {r.share:>8.1f} "
              f"{r.calls:>10} {r.bytes:>11,}" + (f" {r.imbalance:>11.2f}" if moe else ""))


def _bare_rank(rank: int, port: int, hidden: int, reps: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    times = {}
    for rows in (1, 8, PREFILL_TOKENS):
        x = torch.randn(rows, hidden)
        for _ in range(10):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        times[rows] = (time.perf_counter() - start) / reps
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def bare_all_reduce(hidden: int, reps: int = 200) -> dict[int, float]:
    """Seconds per gloo all-reduce of [rows, hidden] fp32 between two idle processes
    (one thread each), by rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_bare_rank, args=(r, port, hidden, reps, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint whose heads 2 divides (default: the "
                                    "SmolLM2-shaped random Llama, built in a temp directory)")
    ap.add_argument("--layers", type=int, default=30, help="layers of the default model")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per batch")
    ap.add_argument("--prefills", type=int, default=3, help="prefill steps timed")
    ap.add_argument("--tp1", action="store_true", help="also run the steps at TP 1")
    ap.add_argument("--moe", action="store_true",
                    help="the default model as a Mixtral (8 experts of 768, top 2), at TP 2 "
                         "split by expert width and by experts (--enable-expert-parallel)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}; {torch.get_num_threads()} torch threads; gloo over 127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        path = (Path(args.model) if args.model
                else build_model(Path(tmp), args.layers, args.moe))
        if args.tp1:  # first: TP 2 leaves this process at its rank's thread count
            print_table("TP 1 (one process, every core; no collectives)",
                        measure(path, 1, args.decode_steps, args.prefills))
        print_table("TP 2 (two gloo ranks, one core each); collectives timed on rank 0",
                    measure(path, 2, args.decode_steps, args.prefills))
        if args.moe:
            print_table("TP 2 with --enable-expert-parallel (4 whole experts a rank)",
                        measure(path, 2, args.decode_steps, args.prefills,
                                expert_parallel=True))
        hidden = json.loads((path / "config.json").read_text())["hidden_size"] \
            if path.is_dir() else SMOLLM2_SHAPES["hidden_size"]
    print(f"\nbare gloo all-reduce of [rows, {hidden}] fp32, two idle processes")
    for rows, sec in bare_all_reduce(hidden).items():
        print(f"  rows {rows:>4} ({rows * hidden * 4:>9,} B): {sec * 1e3:.2f} ms per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
