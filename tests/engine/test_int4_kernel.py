"""Our small-batch int4 kernels: the products they compute are the dequantized weights',
for every group size and row counts across their passes; they run under torch.compile;
a machine that can build neither multiplies with aten's kernel and says so.

* ``tiles`` (engine/quant/csrc/int4_mm.cpp, bf16, AVX-512 BF16): on each of its paths
  (AVX-512 FMAs for a row or two; from INT4_AMX_MIN_ROWS AMX tiles, where the CPU has them,
  else from INT4_DOT_MIN_ROWS vdpbf16ps), blocks of 8 and 16 rows;
* ``blocks`` (csrc/block_mm.cpp, AVX2 + FMA + F16C, fp32 sums; the AVX2 host's): exact to
  fp32 rounding (the same bound as tests/engine/test_quant.py), passes of 4 rows."""
from __future__ import annotations

import pytest
import torch

from engine.compile.decode import cpu_options
from engine.quant import blocks as bk
from engine.quant import packed as pk
from engine.quant.blocks import block_values
from tests.engine.test_quant import within_fp32_rounding

NEVER = 1 << 30
PATHS = {"amx": (pk.INT4_AMX_MIN_ROWS, NEVER), "fma": (NEVER, NEVER), "dot": (NEVER, 1)}
"""(amx_min_rows, dot_min_rows) per path of tandem::int4_mm: "amx" runs on AMX where the
CPU has it (else on the FMA path), "dot" on vdpbf16ps from one row."""


@pytest.fixture(scope="module")
def kernel() -> None:
    if pk.INT4_KERNEL.unavailable() is not None:
        pytest.skip(f"int4 kernel: {pk.INT4_KERNEL.unavailable()}")


def weights(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.02).bfloat16().float()
    z = (torch.randn(n, k // g, generator=gen) * 0.02).bfloat16().float()
    w = ((q.float().view(n, -1, g) - 8) * s[..., None] + z[..., None]).view(n, k)
    return q, s, z, w


def close_to(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within bf16 rounding of the output (the sums are fp32)."""
    return bool(((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all())


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_products_are_the_dequantized_weights_on_every_path(kernel, g: int) -> None:
    n, k = 48, 512
    q, s, z, w = weights(n, k, g)
    tiles = pk.pack_int4(q, s, z, g, torch.bfloat16)
    assert tiles.layout == "tiles" and tiles.data.shape == (n // 16, k // 2, 16)
    for m in (1, 2, 3, 7, 8, 9, 16, 17, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        ref = x.float() @ w.t()
        for path, (amx_min, dot_min) in PATHS.items():
            y = torch.ops.tandem.int4_mm(x, tiles.data, tiles.scales, g, amx_min, dot_min)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert close_to(y, ref), (m, path, (y.float() - ref).abs().max())


def test_the_dot_path_runs_and_a_packed_weight_takes_it(kernel) -> None:
    """vdpbf16ps reads bf16 subnormals as zero (the ISA's rule, as in the dense bf16 GEMM);
    the FMA path keeps them. A subnormal activation against a huge scale tells the paths
    apart: the dot path is not the FMA path under another name, and a packed weight's
    calls from INT4_DOT_MIN_ROWS rows take it (or AMX, where the CPU has it)."""
    n, k = 16, 64
    scales = torch.full((n, 2), 2.0 ** 100)
    tiles = pk.pack_int4(torch.full((n, k), 15), scales, 8 * scales, 32, torch.bfloat16)
    assert tiles.dot_min_rows == pk.INT4_DOT_MIN_ROWS
    x = torch.full((pk.INT4_DOT_MIN_ROWS, k), 2.0 ** -130).bfloat16()  # subnormal in bf16
    fma, dot = (torch.ops.tandem.int4_mm(x, tiles.data, tiles.scales, 32, *PATHS[p])
                for p in ("fma", "dot"))
    assert torch.equal(fma, torch.full_like(fma, 15 * k * 2.0 ** -30))
    assert torch.equal(dot, torch.zeros_like(dot))
    if tiles.amx_min_rows > pk.INT4_DOT_MIN_ROWS:
        assert torch.equal(tiles.matmul(x), dot)
        assert torch.equal(tiles.matmul(x[:pk.INT4_DOT_MIN_ROWS - 1]), fma[1:])


def test_a_row_does_not_depend_on_the_other_rows_of_its_call(kernel) -> None:
    q, s, z, _ = weights(64, 256, 32)
    tiles = pk.pack_int4(q, s, z, 32, torch.bfloat16)
    x = torch.randn(20, 256).bfloat16()
    for amx_min, dot_min in ((1, NEVER), (NEVER, 1), (NEVER, NEVER)):
        whole = torch.ops.tandem.int4_mm(x, tiles.data, tiles.scales, 32, amx_min, dot_min)
        part = torch.ops.tandem.int4_mm(x[5:13], tiles.data, tiles.scales, 32, amx_min, dot_min)
        if (amx_min == 1 and pk.amx_min_rows() < NEVER) or dot_min == 1:
            # AMX, vdpbf16ps: every row's sums come out of the same instructions
            assert torch.equal(whole[5:13], part)
        else:  # FMA: a pass takes up to 8 rows, each with the same accumulators
            assert torch.equal(whole[8:16], torch.ops.tandem.int4_mm(
                x[8:16], tiles.data, tiles.scales, 32, amx_min, dot_min))


def test_it_agrees_with_atens_kernel_and_runs_compiled(kernel) -> None:
    q, s, z, w = weights(96, 576, 32, seed=3)
    tiles = pk.pack_int4(q, s, z, 32, torch.bfloat16)
    aten = pk.pack_int4(q, s, z, 32, torch.bfloat16, layout="aten")
    x = torch.randn(5, 576).bfloat16()
    ref = x.float() @ w.t()
    assert close_to(tiles.matmul(x), ref) and close_to(aten.matmul(x), ref)
    compiled = torch.compile(lambda t: tiles.matmul(t) * 2, fullgraph=True, options=cpu_options())
    assert torch.equal(compiled(x), tiles.matmul(x) * 2)
    assert close_to(tiles.dequantize(), w)
    fp32 = "blocks" if pk.blocks_layout(torch.float32, torch.device("cpu")) else "aten"
    assert pk.pack_int4(q, s, z, 32, torch.float32).layout == fp32  # tiles are bf16 only


def test_bad_input_is_an_error_naming_it(kernel) -> None:
    q, s, z, _ = weights(16, 64, 32)
    tiles = pk.pack_int4(q, s, z, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.tandem.int4_mm(torch.randn(2, 64), tiles.data, tiles.scales, 32, 3)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.tandem.int4_mm(torch.randn(2, 32).bfloat16(), tiles.data, tiles.scales, 32, 3)


@pytest.fixture(scope="module")
def block_kernel() -> None:
    if bk.BLOCK_KERNEL.unavailable() is not None:
        pytest.skip(f"block kernel: {bk.BLOCK_KERNEL.unavailable()}")


@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_products_are_exact_to_fp32_rounding(block_kernel, g: int,
                                                          dtype: torch.dtype) -> None:
    n, k = 48, 512
    q, s, z, _ = weights(n, k, g)
    p = pk.pack_int4(q, s, z, g, dtype, layout="blocks")
    assert p.layout == "blocks" and p.data.shape == (n, k // 2)
    w = block_values(p.data, p.scales, g)
    assert torch.equal(p.dequantize(), w)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = p.matmul(x)
        assert y.shape == (m, n) and y.dtype == dtype
        if dtype == torch.float32:
            assert within_fp32_rounding(y, x, w) <= 1.0, m
        else:  # fp32 sums, rounded to bf16 once
            assert close_to(y, x.float() @ w.t()), m


def test_block_kernel_rows_and_compile(block_kernel) -> None:
    """A row depends only on its pass of 4 rows; the op traces under torch.compile; bad
    input is an error naming it."""
    q, s, z, _ = weights(64, 256, 32)
    p = pk.pack_int4(q, s, z, 32, torch.float32, layout="blocks")
    x = torch.randn(20, 256)
    assert torch.equal(p.matmul(x)[4:12], p.matmul(x[4:12]))
    compiled = torch.compile(lambda t: p.matmul(t) * 2, fullgraph=True, options=cpu_options())
    assert torch.equal(compiled(x[:5]), p.matmul(x[:5]) * 2)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.tandem.block_mm(x.half(), p.data, p.scales, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.tandem.block_mm(x[:, :128], p.data, p.scales, 32)


@pytest.mark.parametrize("groups", [2048, 2049])
def test_block_kernel_takes_rows_longer_than_its_stack_buffer(block_kernel, groups: int) -> None:
    """A pass keeps an output's (d, m) in fp32 on its stack for up to 2048 groups and on the
    heap past that: both products are the dequantized weights' (a row of 65,568 columns
    once read past the stack buffer)."""
    n, k = 3, 32 * groups
    q, s, z, _ = weights(n, k, 32)
    p = pk.pack_int4(q, s, z, 32, torch.float32, layout="blocks")
    w = block_values(p.data, p.scales, 32)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(groups))
    for rows in (1, 2):
        assert within_fp32_rounding(p.matmul(x[:rows]), x[:rows], w) <= 1.0, rows


def test_without_the_kernels_int4_runs_on_atens_and_says_why(monkeypatch) -> None:
    monkeypatch.setattr(pk.INT4_KERNEL, "unavailable", lambda: "no compiler (test)")
    monkeypatch.setattr(bk.BLOCK_KERNEL, "unavailable", lambda: "no compiler (test)")
    q, s, z, w = weights(32, 64, 32)
    p = pk.pack_int4(q, s, z, 32, torch.bfloat16)
    assert p.layout == "aten"
    x = torch.randn(3, 64).bfloat16()
    assert close_to(p.matmul(x), x.float() @ w.t())
    with pytest.raises(RuntimeError, match="no compiler"):
        pk.pack_int4(q, s, z, 32, torch.bfloat16, layout="tiles")


def test_an_int4_engine_runs_ours_or_reports_the_fallback(tiny_model_dir, monkeypatch) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.quant.linear import QuantLinear
    from core.sampling import SamplingParams

    def start():
        eng = LLMEngine(EngineConfig.from_flat(model=str(tiny_model_dir), dtype="bfloat16",
                                               quantization="int4", num_kv_blocks=64))
        layouts = {m.layout for m in eng.runner.model.modules() if isinstance(m, QuantLinear)}
        out = eng.generate([[5, 9, 11]] * 3, SamplingParams(max_tokens=6, ignore_eos=True))
        assert all(len(c.token_ids) == 6 for c in out)
        eng.leak_check()
        fallbacks = eng.runner.fallbacks()
        return layouts, fallbacks["int4_mm"], fallbacks["block_mm"]

    if pk.INT4_KERNEL.unavailable() is None:
        assert start() == ({"tiles"}, [], [])
    elif bk.BLOCK_KERNEL.unavailable() is None:  # an AVX2 host: ours, not a fallback
        assert start() == ({"blocks"}, [], [])
    monkeypatch.setattr(pk.INT4_KERNEL, "unavailable", lambda: "no compiler (test)")
    monkeypatch.setattr(bk.BLOCK_KERNEL, "unavailable", lambda: "no compiler (test)")
    assert start() == ({"aten"}, ["no compiler (test)"], ["no compiler (test)"])


def test_the_gemm_benchmark_times_every_path(kernel) -> None:
    """bench/dense_gemm.py --int4 (docs/performance.md, int4_mm.cpp's header) on one layer:
    a row per row count, with the dense GEMMs and each int4_mm path this CPU runs."""
    import subprocess
    import sys
    from pathlib import Path

    from engine.layers import dense

    if dense.unavailable(torch.empty(1, dtype=torch.bfloat16)):
        pytest.skip(f"prepacked GEMM: {dense.unavailable(torch.empty(1, dtype=torch.bfloat16))}")
    script = Path(__file__).resolve().parents[2] / "bench" / "dense_gemm.py"
    out = subprocess.run([sys.executable, str(script), "--int4", "--rows", "1,8",
                          "--layers", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    paths = ["FMA", "vdpbf16ps"] + (["AMX"] if pk.amx_min_rows() < NEVER else [])
    assert lines[-3] == ("rows | plain ms | prepacked ms | speed-up"
                         + "".join(f" | int4 {p} ms" for p in paths)), out.stdout
    assert [ln.split(" | ")[0] for ln in lines[-2:]] == ["1", "8"]
    assert all(len(ln.split(" | ")) == 4 + len(paths) for ln in lines[-2:])
