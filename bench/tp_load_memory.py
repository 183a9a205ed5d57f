"""What loading a model costs one rank in memory at --tensor-parallel-size 1 and 2: rank
0's peak private resident memory (RssAnon, sampled every 2 ms) while the engine starts,
less what the process held before (Python, torch and the engine imported), beside the
bytes of the weights it keeps. File pages are left out of that: safetensors maps the
file, and its pages are the page cache's, shared by the ranks. What of the checkpoint a
rank touches is shown apart: the pages of each ``.safetensors`` file mapped into its
process (/proc/self/smaps) when the loader is done with the file, summed. The kernel
maps a few neighbouring pages per fault, so small tensors count whole.

A rank splits the model's meta skeleton before anything is allocated and cuts each
checkpoint tensor to its part as it loads (engine/models/weights.py ``Cut``), so at
TP 2 a rank should peak near half the weights plus the largest checkpoint tensor in
flight (the embedding), not at the whole model as when each rank loaded everything and
then narrowed it. Each configuration runs in a fresh process; rank 1 (its child) loads
the same way. Compilation is off and the KV pool small (16 blocks): the numbers are
the weights'.

The default model is a seeded random Llama of SmolLM2-135M's shapes with the heads cut
12 x 48 (bench/tp_allreduce.py): 30 layers, hidden 576, MLP 1536, 49152-entry tied
vocabulary, fp32. --layers changes its depth; --model runs another checkpoint whose
heads 2 divides.

    python bench/tp_load_memory.py [--model DIR] [--layers 30]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

_ONE = """
import json, sys, threading, time
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
def anon_mb():  # this process's private resident memory (file pages, e.g. mmap, left out)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
def checkpoint_mb():  # pages of the checkpoint's files mapped into this process now
    kb, mine = 0, False
    for line in open("/proc/self/smaps"):
        if not line[0].isupper():  # a mapping's header: address range ... path
            mine = line.rstrip().endswith(".safetensors")
        elif mine and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb / 1024
import engine.loader.hf_loader as hf_loader
pages, real_open = [0.0], hf_loader.safe_open
class CountedOpen:  # what each file has mapped when the loader is done with it
    def __init__(self, *args, **kw):
        self._file = real_open(*args, **kw)
    def __enter__(self):
        return self._file.__enter__()
    def __exit__(self, *exc):
        pages[0] += checkpoint_mb()
        return self._file.__exit__(*exc)
hf_loader.safe_open = CountedOpen
peak, done = [anon_mb()], threading.Event()
def watch():
    while not done.wait(0.002):
        peak.append(max(peak[-1], anon_mb()))
before = peak[0]
threading.Thread(target=watch, daemon=True).start()
tp = int(sys.argv[2])
eng = LLMEngine(EngineConfig.from_flat(model=sys.argv[1], dtype="float32", quantization="none",
                                       num_kv_blocks=16, block_size=16, max_model_len=256,
                                       swap_space=0, preemption_mode="recompute", compile=False,
                                       tensor_parallel_size=tp))
done.set()
held = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters()) / 2**20
eng.close()
print(json.dumps({"held": held, "peak": max(peak) - before, "pages": pages[0]}))
"""


def measure(model: Path, tp: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _ONE, str(model), str(tp)], text=True,
                          capture_output=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        raise SystemExit(f"TP {tp} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint whose heads 2 divides (default: the "
                                    "SmolLM2-shaped random Llama, built in a temp directory)")
    ap.add_argument("--layers", type=int, default=30, help="layers of the default model")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        else:
            from bench.tp_allreduce import build_model
            model = build_model(Path(tmp), args.layers)
        files = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
        print(f"model {model.name}: {files:.0f} MB of safetensors")
        print(f"{'TP':>3} {'weights held MB':>16} {'peak private memory added MB':>29} "
              f"{'checkpoint pages touched MB':>28}")
        for tp in (1, 2):
            r = measure(model, tp)
            print(f"{tp:>3} {r['held']:>16.0f} {r['peak']:>29.0f} {r['pages']:>28.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
