"""bench/decode_steps.py (docs/performance.md, decode steps as graphs of layers): engine
set-ups in one process, stepped in turn, on the tiny model."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "decode_steps.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_each_set_up_prints_its_median_step_its_ratio_and_whether_its_tokens_agree(
        tiny_model_dir) -> None:
    """An eager engine and one compiled with 2-row steps as graphs of one layer, fp32: the
    same tokens."""
    common = "dtype=float32,num_kv_blocks=64,max_num_seqs=2,max_model_len=256"
    out = _run("--model", str(tiny_model_dir), "--rows", "2", "--steps", "3",
               "--prompt-len", "8", f"eager:compile=False,{common}",
               f"groups:compile=True,compile_max_batch=2,compile_graph_max_batch=1,"
               f"compile_graph_layers=1,{common}")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()[1:]
    assert len(lines) == 2 and lines[0].split()[2] == "eager" and lines[1].split()[2] == "groups"
    assert all(re.fullmatch(r"  2 rows  \w+ +median +[\d.]+ ms  [\d.]+x  "
                            r"tokens equal eager's: True", ln) for ln in lines), lines
    assert " 1.000x " in lines[0]


def test_a_flag_without_a_value_is_refused_by_name() -> None:
    out = _run("groups:compile_graph_layers")
    assert out.returncode != 0
    assert "decode_steps: 'compile_graph_layers' is not KEY=VALUE" in out.stderr
