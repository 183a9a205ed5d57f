"""bench/c1_ab.py (docs/performance.md, the AVX2-only host): two engine set-ups in one
process, interleaved, on the tiny model."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "c1_ab.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_the_ab_benchmark_prints_each_round_and_the_medians(tiny_model_dir) -> None:
    out = _run("--model", str(tiny_model_dir), "--rounds", "2", "--tokens", "3",
               "--prompt-len", "8", "--both", "compile=False", "max_model_len=64",
               "num_kv_blocks=32", "--b", "quantization=none", "inductor.cpp_wrapper=True")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].endswith("both: compile=False max_model_len=64 num_kv_blocks=32; "
                             "A: defaults; B: quantization=none inductor.cpp_wrapper=True")
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert len(rounds) == 2
    # the tiny model's fp32 weights are not quantized by default: the same tokens
    assert all(re.fullmatch(r"round \d: A [\d.]+ ms, B [\d.]+ ms, B/A [\d.]+, tokens equal", ln)
               for ln in rounds), rounds
    assert re.fullmatch(r"medians: A [\d.]+ ms, B [\d.]+ ms, B/A [\d.]+; "
                        r"tokens equal in 2 of 2 rounds", lines[-1]), lines[-1]


def test_a_setting_without_a_value_is_refused_by_name() -> None:
    out = _run("--b", "cpp_wrapper")
    assert out.returncode != 0
    assert "'cpp_wrapper' is not KEY=VALUE" in out.stderr


def test_an_inductor_option_keeps_both_engines_one_graph_steps(tiny_model_dir) -> None:
    """With an inductor option on one side, both engines time their own compiled one-graph
    batch-1 step: clearing dynamo's cache between the builds (as the script once did) made
    engine A's next step a recompile, which a one-graph step refuses, so A fell back to
    per-layer steps and B/A compared two different steps."""
    out = _run("--model", str(tiny_model_dir), "--rounds", "1", "--tokens", "3",
               "--prompt-len", "8", "--both", "max_model_len=64", "num_kv_blocks=32",
               "--b", "inductor.max_autotune=False")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "one-graph decode step" not in out.stderr, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].endswith("tokens equal in 1 of 1 rounds")


def test_the_timed_window_holds_only_the_decode_steps(tiny_model_dir, monkeypatch) -> None:
    """tpot's clock starts after the prompt's first token and stops after its last: only
    decode steps in between. It once timed a 1-token request and the same prompt again,
    and the second one's prefill found the first one's blocks in the prefix cache: a
    prefill step inside the window, and TPOT short by the cached part of the prefill."""
    monkeypatch.syspath_prepend(str(SCRIPT.parents[1]))
    import bench.c1_ab as ab

    eng = ab.build(str(tiny_model_dir), {"compile": False, "max_model_len": 64,
                                          "num_kv_blocks": 32}, {})
    prefill_steps: list[bool] = []  # per step: did a request still wait for its first token
    real_step = eng.step

    def step():
        prefill_steps.append(any(r.num_output_tokens == 0 for r in eng.requests.values()))
        return real_step()

    marks: list[int] = []

    def clock() -> float:
        marks.append(len(prefill_steps))
        return float(len(prefill_steps))

    monkeypatch.setattr(eng, "step", step)
    monkeypatch.setattr(ab, "time", SimpleNamespace(perf_counter=clock))
    prompt = list(range(10, 50))  # two full blocks: a repeat would hit the prefix cache
    ms, ids = ab.tpot(eng, {}, prompt, 3)
    window = prefill_steps[marks[0]:marks[-1]]
    assert window == [False, False, False], (marks, prefill_steps)
    assert ms == 1000.0 and len(ids) == 4
    eng.leak_check()
