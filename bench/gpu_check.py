"""One prepared check for a machine with a CUDA GPU (under 5 minutes on one H200):
every GPU path of the engine against its reference, and the speeds that matter.

Rows of the one table it prints:

* attention: flash-attn varlen prefill and paged decode vs SDPA and the naive
  reference (max abs error, bf16), and the sdpa backend on CUDA vs naive;
* quantized KV cache (--kv-cache-dtype int8, fp8_e4m3): flash_attn and sdpa on CUDA
  over a quantized cache vs the naive reference with the same quantization;
* quantized kernels on CUDA: int8 (``_weight_int8pack_mm``) and int4
  (``_weight_int4pack_mm``) vs their dequantized weights, and their time vs a bf16
  GEMM at 1 and 32 rows;
* compiled decode (CUDA graphs per bucket) vs eager: tokens identical (fp32) and
  step time (bf16);
* swap: a CUDA -> pinned host -> CUDA round trip of KV blocks (bytes equal, GB/s);
* decode tokens/s at batch 1, 32 and 256, and prefill tokens/s (512-token prompts),
  bf16, on the embedded model (or --model);
* with two or more GPUs, tensor parallelism (NCCL): greedy tokens at TP 2 equal TP 1's
  (fp32), and the share of a step in the model's collectives at TP 2 (bench/tp_allreduce.py's
  table on SmolLM2-shaped random weights; docs/performance.md n has the CPU's).

On a machine without CUDA it prints "no CUDA" and exits 0.

    .venv/bin/python bench/gpu_check.py [--model PATH] [--quick]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

ROWS: list[tuple[str, str, str]] = []  # (check, result, detail)


def row(check: str, result: str, detail: str = "") -> None:
    ROWS.append((check, result, detail))
    print(f"  {check}: {result} {detail}", flush=True)


def guarded(check: str):
    """Run one check; an exception becomes a FAIL row, not the end of the script."""
    def wrap(fn):
        def run(*a, **kw):
            try:
                return fn(*a, **kw)
            except Exception as e:  # a check that cannot run is a result too
                row(check, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return run
    return wrap


def cuda_time(fn, reps: int = 20) -> float:
    """Median ms of fn() on the GPU (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def attention_case(block_size: int, dtype=torch.bfloat16):
    from engine.attention.metadata import build_metadata

    rng = random.Random(block_size)
    hq, hkv, d, layers = 8, 2, 64, 2
    specs = [(0, 300), (64, 77), (0, 5)] + [(rng.randint(1, 900), 1) for _ in range(12)]
    nblocks = sum(-(-(c + n) // block_size) for c, n in specs) + 2
    kv = torch.randn(nblocks, layers, 2, block_size, hkv, d, dtype=dtype)
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in specs]
    qlens, slens = [n for _, n in specs], [c + n for c, n in specs]
    meta = build_metadata(qlens, slens, 3, tables, block_size)
    t = sum(qlens)
    q, k, v = (torch.randn(t, h, d, dtype=dtype) for h in (hq, hkv, hkv))
    return q, k, v, kv, meta


@guarded("attention")
def check_attention() -> None:
    from engine.attention import build_metadata, get_backend
    from engine.attention.base import LayerAttention
    from engine.attention.naive import NaiveBackend
    SCALE = LayerAttention(0.125)

    for name in ("flash_attn", "sdpa"):
        for block_size in (16, 256):
            q, k, v, kv, meta = attention_case(block_size)
            ref = NaiveBackend().forward(0, q, k, v, kv.clone(), meta, SCALE)
            cu = build_metadata(meta.query_lens, meta.seq_lens, meta.num_prefills,
                                meta.block_tables, block_size, "cuda")
            try:
                backend = get_backend(name, "cuda")
            except RuntimeError as e:
                row(f"attention {name}", "SKIP", str(e))
                break
            out = backend.forward(0, q.cuda(), k.cuda(), v.cuda(), kv.clone().cuda(), cu, SCALE)
            err = (out.float().cpu() - ref.float()).abs().max().item()
            ms = cuda_time(lambda: backend.forward(0, q.cuda(), k.cuda(), v.cuda(), kv.cuda(), cu, SCALE))
            row(f"attention {name} block {block_size}", "OK" if err < 3e-2 else "FAIL",
                f"max err vs naive {err:.2e}; {ms:.3f} ms (3 prefills + 12 decodes)")


@guarded("quantized KV")
def check_kv_quant() -> None:
    from engine.attention import build_metadata, get_backend
    from engine.attention.base import LayerAttention
    from engine.attention.naive import NaiveBackend
    SCALE = LayerAttention(0.125)
    from engine.kv_cache.quant import encode

    for quant in ("int8", "fp8_e4m3"):
        q, k, v, kv, meta = attention_case(16)
        kv = encode(kv, quant)
        args = (meta.query_lens, meta.seq_lens, meta.num_prefills, meta.block_tables, 16)
        ref = NaiveBackend().forward(0, q, k, v, kv.clone(), build_metadata(*args, kv_quant=quant),
                                     SCALE)
        for name in ("flash_attn", "sdpa"):
            try:
                backend = get_backend(name, "cuda")
            except RuntimeError as e:
                row(f"kv {quant} {name}", "SKIP", str(e))
                continue
            cu = build_metadata(*args, device="cuda", kv_quant=quant)
            out = backend.forward(0, q.cuda(), k.cuda(), v.cuda(), kv.clone().cuda(), cu, SCALE)
            err = (out.float().cpu() - ref.float()).abs().max().item()
            row(f"kv {quant} {name}", "OK" if err < 3e-2 else "FAIL", f"max err vs naive {err:.2e}")


@guarded("quantized kernels")
def check_quant() -> None:
    import torch.nn.functional as F

    from engine.quant.base import get_method

    w = torch.randn(4096, 4096) * 0.02
    for method in ("int8", "int4"):
        packed, values = get_method(method).pack("w", w.cuda(), torch.bfloat16)
        dense = values.to(torch.bfloat16).cuda()
        x1, x32 = (torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda") for m in (1, 32))
        err = (packed.matmul(x32).float() - F.linear(x32, dense).float()).abs().max().item()
        t = [cuda_time(lambda: packed.matmul(x)) for x in (x1, x32)]
        td = [cuda_time(lambda: F.linear(x, dense)) for x in (x1, x32)]
        row(f"quant {method} 4096x4096", "OK" if err < 0.5 else "FAIL",
            f"max err vs dequantized {err:.2e}; M=1 {t[0]:.3f} vs bf16 {td[0]:.3f} ms; "
            f"M=32 {t[1]:.3f} vs {td[1]:.3f} ms")


def engine(model: str, dtype: str, compile: bool, **kw):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_flat(model=model, dtype=dtype, device="cuda", compile=compile,
                                            max_model_len=2048, **kw))


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(n)]


@guarded("compiled decode")
def check_compiled(model: str) -> None:
    from core.sampling import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ps = prompts(4, 32)
    want = [c.token_ids for c in engine(model, "float32", False, max_num_seqs=8).generate(ps, params)]
    eng = engine(model, "float32", True, max_num_seqs=8)
    eng.runner.compiled.slower.clear()
    got = [c.token_ids for c in eng.generate(ps, params)]
    row("compiled decode fp32 == eager", "OK" if got == want else "FAIL",
        f"buckets {eng.runner.compiled.buckets}; disabled: {eng.runner.compiled.disabled}")
    bf = engine(model, "bfloat16", True, max_num_seqs=32)
    times = ", ".join(f"b{b}: {c:.2f} vs {e:.2f} ms" for b, (c, e) in bf.runner.compiled.timings.items())
    row("CUDA-graph decode vs eager (bf16 dummy step)", "INFO", times)


@guarded("swap")
def check_swap(model: str) -> None:
    eng = engine(model, "bfloat16", False, num_kv_blocks=512, swap_space=1.0)
    r = eng.runner
    n = min(256, r.num_swap_blocks)
    r.kv[:n].normal_()
    before = r.kv[:n].clone()
    t0 = time.perf_counter()
    nbytes = r.copy_blocks([(list(range(n)), list(range(n)))], [])
    r.kv[:n].zero_()
    nbytes += r.copy_blocks([], [(list(range(n)), list(range(n)))])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = torch.equal(r.kv[:n], before)
    row("swap out + in round trip", "OK" if ok else "FAIL",
        f"{n} blocks, {nbytes / 1e6:.1f} MB in {dt * 1e3:.1f} ms ({nbytes / dt / 1e9:.2f} GB/s)")


@guarded("throughput")
def check_throughput(model: str, quick: bool) -> None:
    from core.sampling import SamplingParams

    eng = engine(model, "bfloat16", True, max_num_seqs=256, num_kv_blocks=8192,
                 max_num_batched_tokens=4096)
    new = 32 if quick else 64
    for batch in (1, 32, 256):
        ids = [eng.add_request(p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
               for p in prompts(batch, 64, batch)]
        steps = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
        p50 = statistics.median(steps[2:])
        row(f"decode batch {batch}", "INFO", f"{batch / p50:,.0f} tok/s (p50 step {p50 * 1e3:.2f} ms)")
        del ids
    ps = prompts(8, 512, 7)
    t0 = time.perf_counter()
    eng.generate(ps, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    row("prefill 8 x 512 tokens", "INFO", f"{8 * 512 / (time.perf_counter() - t0):,.0f} tok/s")


@guarded("tensor parallel")
def check_tp() -> None:
    """TP 2 against TP 1 on two GPUs: tokens (fp32) and the collectives' share."""
    import tempfile

    from core.sampling import SamplingParams
    from tp_allreduce import build_model, measure, print_table

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_model(Path(tmp), layers=4))
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        ps = prompts(8, 32)  # ids below the model's 49152
        tokens = {}
        for tp in (1, 2):
            eng = engine(path, "float32", False, tensor_parallel_size=tp, quantization="none")
            try:
                tokens[tp] = [c.token_ids for c in eng.generate(ps, params)]
            finally:
                eng.close()
        same = sum(a == b for a, b in zip(tokens[1], tokens[2]))
        row("TP 2 == TP 1 greedy tokens (fp32, NCCL)", "OK" if same == len(ps) else "FAIL",
            f"{same}/{len(ps)} prompts x 16 tokens")
        rows = measure(build_model(Path(tmp) / "full", layers=30), 2, 16, 3, device="cuda")
    print_table("TP 2 on two GPUs (NCCL); collectives timed on rank 0", rows)
    for r in rows:
        row(f"TP 2 collectives share, {r.kind}", "INFO",
            f"{r.share:.1f}% of {r.step_ms:.2f} ms ({r.calls} collectives, {r.bytes:,} B)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: this machine has no usable GPU; gpu_check has nothing to check")
        return 0
    from tandem.fetch_model import default_model_path

    model = args.model or str(default_model_path())
    t0 = time.perf_counter()
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)
    check_attention()
    check_kv_quant()
    check_quant()
    check_compiled(model)
    check_swap(model)
    check_throughput(model, args.quick)
    if torch.cuda.device_count() >= 2:
        check_tp()
    else:
        row("tensor parallel", "SKIP", f"{torch.cuda.device_count()} GPU: TP 2 needs two")
    width = max(len(c) for c, _, _ in ROWS)
    print(f"\n{'check':{width}s}  result  detail")
    for check, result, detail in ROWS:
        print(f"{check:{width}s}  {result:6s}  {detail}")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s; "
          f"{sum(r == 'FAIL' for _, r, _ in ROWS)} failed")
    return 1 if any(r == "FAIL" for _, r, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
