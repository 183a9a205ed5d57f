"""Building a model costs no more than its weights: the skeleton is made on the meta
device without running torch's random init (engine/models/base.py meta_skeleton), so a
worker with compilation off never imports torch._dynamo (1.4 s of every start-up when a
meta tensor's normal_ ran torch's Python reference), nor sympy (0.4 s, when to_empty's
empty_like of a meta tensor ran that reference: base.py materialize)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
eng = LLMEngine(EngineConfig.from_flat(model=sys.argv[1], dtype="float32", num_kv_blocks=32,
                                       max_model_len=64, compile=False))
print(eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids)
print("torch._dynamo" in sys.modules, "sympy" in sys.modules, torch.nn.init.normal_.__name__)
"""


def test_an_engine_without_compilation_never_imports_dynamo_or_sympy(tiny_model_dir) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_COMPILE": "0"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    tokens, flags = out.stdout.strip().splitlines()[-2:]
    assert len(eval(tokens)) == 3
    assert flags == "False False normal_", "dynamo or sympy imported, or torch's init left patched"
