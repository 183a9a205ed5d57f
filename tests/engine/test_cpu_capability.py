"""The CPU capability ceiling ($TANDEM_CPU_CAPABILITY, else $ATEN_CPU_CAPABILITY): an
Intel host with AMX and AVX-512 BF16, capped at avx2, sees and builds what an AVX2-only
AMD EPYC does, so the suite can be run once as on that CPU (README, "CPUs")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import native
from engine.config import cpu_has_fast_bf16, resolve_dtype

SAPPHIRE_RAPIDS = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                   "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def intel(monkeypatch):
    monkeypatch.delenv(native.CAPABILITY_ENV, raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(native, "_cpuinfo_flags", lambda: set(SAPPHIRE_RAPIDS))
    return monkeypatch


def test_uncapped_the_cpu_is_as_it_is(intel) -> None:
    assert native.cpu_capability() is None
    assert native.cpu_flags() == SAPPHIRE_RAPIDS
    assert native.march() == "-march=native"
    assert native.vec_flags() == ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    assert cpu_has_fast_bf16() and resolve_dtype("auto") is torch.bfloat16


@pytest.mark.parametrize("var", [native.CAPABILITY_ENV, "ATEN_CPU_CAPABILITY"])
def test_avx2_hides_avx512_and_amx(intel, var: str) -> None:
    intel.setenv(var, "avx2")
    assert native.cpu_flags() == {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert native.march() == "-march=x86-64-v3"
    assert native.vec_flags() == ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    assert not cpu_has_fast_bf16()
    assert resolve_dtype("auto") is torch.float32  # as on the AMD host


def test_ours_wins_over_atens_and_default_hides_avx_too(intel) -> None:
    intel.setenv("ATEN_CPU_CAPABILITY", "avx512")
    intel.setenv(native.CAPABILITY_ENV, "default")
    assert native.cpu_flags() == {"sse4_2"}
    assert native.vec_flags() == []
    intel.delenv(native.CAPABILITY_ENV)
    assert native.cpu_flags() == SAPPHIRE_RAPIDS - {"amx_tile", "amx_bf16", "amx_int8"}


def test_a_bad_value_of_ours_names_the_variable(intel) -> None:
    intel.setenv(native.CAPABILITY_ENV, "avx3")
    with pytest.raises(ValueError, match=r"\$TANDEM_CPU_CAPABILITY must be one of default, "
                                         r"avx2, avx512; got 'avx3'"):
        native.cpu_flags()
    intel.delenv(native.CAPABILITY_ENV)
    intel.setenv("ATEN_CPU_CAPABILITY", "zvector")  # ATen's, not an x86 ceiling
    assert native.cpu_capability() is None


def test_a_capped_kernel_is_built_apart_and_the_int4_kernel_refused(intel) -> None:
    kernel = native.NativeKernel("probe", ROOT / "engine/attention/csrc/paged_decode.cpp",
                                 lambda: None, without="-",
                                 needs_cpu_flags=("avx512f", "avx512bw", "avx512_bf16"))
    own = kernel.build_directory()
    intel.setenv(native.CAPABILITY_ENV, "avx2")
    assert kernel.build_directory() == own.with_name(own.name + "_avx2")
    assert kernel._build() == "this CPU lacks avx512f, avx512bw, avx512_bf16"


def test_an_avx2_ceiling_reaches_a_new_process() -> None:
    """The variable is read where the engine starts (a worker process), not only here."""
    probe = ("from engine.native import cpu_flags\n"
             "from engine.quant.blocks import kernel_path\n"
             "from engine.quant.packed import INT4_KERNEL, amx_min_rows\n"
             "assert not {f for f in cpu_flags() if f.startswith(('avx512', 'amx'))}\n"
             "assert amx_min_rows() > 1 << 40\n"
             "assert kernel_path()[0].startswith('weight kernels: AVX2+FMA block kernel')\n"
             "print(INT4_KERNEL.unavailable())")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ,
                                         native.CAPABILITY_ENV: "avx2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("this CPU lacks avx512f"), r.stdout


def test_an_avx2_ceiling_caps_onednns_gemms() -> None:
    """The dense GEMMs (oneDNN) run AVX2 code under the ceiling too: a capped run on an
    AVX-512 host used them with AVX-512 before."""
    probe = ("import torch\n"
             "import engine.native\n"
             "from engine.layers import dense\n"
             "w = torch.randn(64, 64)\n"
             "dense.linear(torch.randn(8, 64), dense.prepack(w), None)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA",
                                                              "DNNL_MAX_CPU_ISA")}
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**env, native.CAPABILITY_ENV: "avx2",
                                         "ONEDNN_VERBOSE": "1"})
    assert r.returncode == 0, r.stderr
    isa = [ln for ln in r.stdout.splitlines() if ",isa:" in ln]
    assert isa and isa[0].endswith("isa:Intel AVX2"), r.stdout[:2000]


NO_SIMD_PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from prometheus_client import generate_latest
from core.sampling import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from worker.metrics import WorkerMetrics
eng = LLMEngine(EngineConfig.from_flat(model=sys.argv[1], dtype="float32",
                                       quantization="int8", num_kv_blocks=64))
print(eng.generate([[5, 9, 11]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids)
print(eng.runner.fallbacks()["block_mm"])
metrics = WorkerMetrics("decode", "w0")
metrics.observe_engine(eng)
print([ln for ln in generate_latest(metrics.registry).decode().splitlines()
       if ln.startswith("tandem:engine_fallbacks{") and 'kind="block_mm"' in ln])
"""


def test_a_cpu_without_avx2_or_avx512_says_so_and_exports_the_fallback(tiny_model_dir) -> None:
    """Issue 27, bad input: with neither AVX2 nor AVX-512 (the ``default`` ceiling) the
    start-up names the SIMD flags found and the slower path taken (dense linears), the
    engine still generates, and tandem:engine_fallbacks{kind="block_mm"} is 1."""
    r = subprocess.run([sys.executable, "-c", NO_SIMD_PROBE, str(tiny_model_dir)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, native.CAPABILITY_ENV: "default"})
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "weight kernels" in ln)
    assert "weight kernels unavailable: this CPU has neither AVX2 nor AVX-512 (SIMD flags " \
           "found: " in line and "sse4_2" in line and "avx2" not in line.split("found:")[1]
    assert "linears run on their dense copies (slower path)" in line
    tokens, reasons, gauge = r.stdout.strip().splitlines()
    assert len(eval(tokens)) == 3
    assert "neither AVX2 nor AVX-512" in reasons
    assert eval(gauge)[0].endswith(" 1.0"), gauge
