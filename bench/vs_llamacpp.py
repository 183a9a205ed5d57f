"""Tandem (tandem up --mode colocated) vs the llama.cpp server (llama-cpp-python[server])
on the same GGUF file, 2 threads each, through the shared bench client.

Both get the same prompts, output lengths (EOS suppressed) and load: a closed loop of
--concurrency clients (throughput), then one client (batch-1 TPOT). Targets: c32
output throughput >= 3x llama.cpp; batch-1 TPOT <= 1.5x llama.cpp. When
llama-cpp-python is not installed (or cannot load) the script prints why and exits 0.
Build it with (the default build crashes in its AMX path on some Xeons):

    CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \\
      -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \\
      .venv/bin/pip install --no-cache-dir 'llama-cpp-python[server]'

    .venv/bin/python bench/vs_llamacpp.py [--concurrency 32] [--output-len 64]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from tandem.bench import load, profile, report, stats  # noqa: E402
from tandem.bench.client import Endpoint  # noqa: E402
from tandem.bench.script import (BenchRun, add_closed_loop_flags, add_py_spy_flag,  # noqa: E402
                                  batch1_requests, closed_loop_requests)
from tandem.bench.servers import free_port, serve, tandem_up  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402


def llamacpp_available(python: str = sys.executable) -> str | None:
    """None when llama_cpp.server imports in ``python`` (in a child, so a crash cannot take
    us down)."""
    r = subprocess.run([python, "-c", "import llama_cpp, llama_cpp.server.app; "
                        "print(llama_cpp.__version__)"], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return f"llama-cpp-python[server] is not importable ({tail})"
    print(f"llama-cpp-python {r.stdout.strip()}", flush=True)
    return None


def eos_bias(model: str) -> dict[str, float]:
    """logit_bias that keeps llama.cpp from ever sampling an end-of-sequence token
    (its server has no ignore_eos)."""
    from engine.loader import load_checkpoint
    from core.tokenizer import Tokenizer

    ckpt = load_checkpoint(model)
    eos = set(ckpt.config.eos_token_ids)
    tok = Tokenizer.from_gguf(ckpt.reader) if ckpt.reader is not None else Tokenizer.load(model)
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    return {str(t): -100.0 for t in sorted(eos)}


def measure(ep: Endpoint, reqs, args, name: str, pid: int | None = None
            ) -> tuple[stats.Summary, stats.Summary, list]:
    """Closed loop at --concurrency, then one client. With pid and --py-spy, each phase's
    first --py-spy seconds of that process are sampled and summarised on stdout."""
    load.run(ep, reqs[:2], concurrency=1, progress=False)  # warm-up
    c = _phase(ep, reqs, args.concurrency, f"{name} c{args.concurrency}", args, pid)
    b1 = _phase(ep, batch1_requests(args), 1, f"{name} c1", args, pid)  # cold prompts
    for run in (c, b1):
        bad = [r for r in run.results if not r.ok or r.output_tokens != r.request.max_tokens]
        if bad:
            raise RuntimeError(f"{run.label}: {len(bad)} requests failed or came back short: "
                               f"{bad[0].error or bad[0].output_tokens}")
    return (stats.summarize(c.results, c.duration_s), stats.summarize(b1.results, b1.duration_s),
            [(c.label, c.results), (b1.label, b1.results)])


def _phase(ep: Endpoint, reqs, concurrency: int, label: str, args, pid: int | None):
    with profile.sampled(pid, args.py_spy, f"vs_llamacpp.{label.replace(' ', '_')}",
                         f"engine worker, {label}"):
        return load.run(ep, reqs, concurrency=concurrency, label=label)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    add_closed_loop_flags(ap, prompt_len=32, num_prompts=64)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: 2)")
    ap.add_argument("--plot", default=None, help="PNG of the latency CDFs of both servers")
    add_py_spy_flag(ap, "Tandem's engine worker", "phase")
    args = ap.parse_args()
    why = llamacpp_available()
    if why:
        print(f"SKIP vs_llamacpp: {why}. Build it as this script's docstring says.")
        return 0
    bench = BenchRun("vs_llamacpp")
    reqs = closed_loop_requests(args)
    name = Path(args.model).name.removesuffix(".gguf")

    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model,
           "--model_alias", name, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--n_ctx", "2048", "--interrupt_requests", "False"]
    log = Path(tempfile.gettempdir()) / "vs_llamacpp.server.log"
    try:
        with serve(cmd, f"http://127.0.0.1:{port}/v1/models", "llama.cpp server", log=log):
            ep = Endpoint(f"http://127.0.0.1:{port}/v1", name, ignore_eos=False,
                          extra_body={"logit_bias": eos_bias(args.model)})
            lc_c, lc_1, lc_t = measure(ep, reqs, args, "llama.cpp")
    except RuntimeError as e:
        print(f"SKIP vs_llamacpp: the llama.cpp server did not run ({e}); see {log}")
        return 0
    with tandem_up("--mode", "colocated", model=args.model) as srv:
        td_c, td_1, td_t = measure(Endpoint(srv.url, name), reqs, args, "tandem",
                                   pid=srv.children()[0])

    print(f"\n{args.prompt_len}-token prompts, {args.output_len} output tokens, greedy; "
          f"both on {Path(args.model).name} with 2 threads")
    print(report.format_table([(f"tandem c{args.concurrency}", td_c),
                               (f"llama.cpp c{args.concurrency}", lc_c),
                               ("tandem c1", td_1), ("llama.cpp c1", lc_1)]))
    thr = td_c.output_throughput / lc_c.output_throughput
    tpot = td_1.tpot.p50 / lc_1.tpot.p50
    print(f"\n  c{args.concurrency} output tok/s: tandem {td_c.output_throughput:.1f}, "
          f"llama.cpp {lc_c.output_throughput:.1f}")
    print("  " + report.target_line(f"throughput ratio tandem/llama.cpp at c{args.concurrency}",
                                    thr, ">=", 3.0))
    print(f"  c1 TPOT p50: tandem {td_1.tpot.p50 * 1e3:.2f} ms, "
          f"llama.cpp {lc_1.tpot.p50 * 1e3:.2f} ms")
    print("  " + report.target_line("batch-1 TPOT ratio tandem/llama.cpp", tpot, "<=", 1.5))
    if args.plot:
        report.plot_cdfs(args.plot, td_t + lc_t, "Tandem vs llama.cpp server")
    bench.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
