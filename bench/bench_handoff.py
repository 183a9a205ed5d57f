"""Per-request KV transfer time as a share of prefill time, for 1k-token prompts.

Starts one prefill and one decode worker (separate processes, one core each),
then for each backend runs N requests: Prefill (its prefill_seconds), then
Generate with the handle (its trace.transfer_seconds). Prints a table.

    .venv/bin/python bench/bench_handoff.py [--requests 8] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from tests.cluster.launch import cluster  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def run(backend: str, model: Path, n: int, tokens: int, dtype: str) -> dict:
    sp = common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prefill_s, transfer_s, nbytes = [], [], []
    with cluster(model, backend, worker_args=["--dtype", dtype, "--no-enable-prefix-caching"]) as c:
        with c.channel(c.prefill[0]) as pch, c.channel(c.decode[0]) as dch:
            ps, ds = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
            for i in range(n + 1):  # the first request warms up both workers
                ids = [(i * 7919 + j * 31) % 40000 + 100 for j in range(tokens)]
                rid = f"{backend}-{i}"
                r = ps.Prefill(prefill_pb2.PrefillRequest(request_id=rid, token_ids=ids,
                                                          sampling=sp), timeout=300)
                chunks = list(ds.Generate(decode_pb2.GenerateRequest(
                    request_id=rid, prompt_token_ids=ids, output_token_ids=[r.first_token],
                    sampling=sp, kv_handle=r.kv_handle), timeout=300))
                t = chunks[0].trace
                if i == 0:
                    continue
                assert t.fallback == decode_pb2.FALLBACK_REASON_UNSPECIFIED, t.fallback
                prefill_s.append(r.prefill_seconds)
                transfer_s.append(t.transfer_seconds)
                nbytes.append(t.bytes_pulled)
    p, x = statistics.median(prefill_s), statistics.median(transfer_s)
    return {"backend": backend, "prefill_ms": p * 1e3, "transfer_ms": x * 1e3,
            "share": x / p, "mib": nbytes[0] / 2**20, "gbps": nbytes[0] / x / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backends", default="nixl,tcp")
    args = ap.parse_args()
    rows = [run(b, Path(args.model), args.requests, args.tokens, args.dtype)
            for b in args.backends.split(",")]
    print(f"\n{args.tokens}-token prompts, median of {args.requests} requests "
          f"(dtype {args.dtype}, 1 core per worker)")
    print(f"{'backend':8} {'prefill ms':>11} {'transfer ms':>12} {'share':>7} {'KV MiB':>7} {'GB/s':>6}")
    for r in rows:
        print(f"{r['backend']:8} {r['prefill_ms']:11.1f} {r['transfer_ms']:12.2f} "
              f"{r['share']:7.2%} {r['mib']:7.1f} {r['gbps']:6.2f}")


if __name__ == "__main__":
    main()
