"""`tandem bench` against a fake OpenAI SSE server with a known schedule.

No wall-clock assertions: the checks are on token counts the fake server puts in
the stream, on statistics computed from injected timestamps, and on seeded
generators.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import time

import numpy as np
import pytest

from tandem import cli
from tandem.bench import datasets, load, report, stats
from tandem.bench.client import Endpoint, RequestResult
from tandem.bench.datasets import BenchRequest, LengthDist
from tests.tandem.fake_openai import FakeOpenAI


@pytest.fixture(scope="module")
def fake():
    with FakeOpenAI(ttft_s=0.05, itl_s=0.01) as server:
        yield server


def _req(n_words: int = 4, max_tokens: int = 5, tag: str = "") -> BenchRequest:
    return BenchRequest(" ".join(["w"] * n_words), n_words, max_tokens, tag)


def _result(ttft: float, itl: float, tokens: int, sent: float = 100.0, ok: bool = True,
            tag: str = "") -> RequestResult:
    """A result whose event stamps follow an exact schedule."""
    r = RequestResult(_req(3, tokens, tag), sent, ok=ok)
    r.chunk_times = [sent + ttft + i * itl for i in range(tokens)]
    r.done = r.chunk_times[-1]
    r.ended = r.done
    r.usage_output_tokens = tokens
    return r


# -- client against the fake server -------------------------------------------------
def test_completions_stream_counts_tokens(fake):
    reqs = [_req(4 + i, 3 + i) for i in range(6)]
    res = load.run(Endpoint(fake.base_url, "fake-model"), reqs, concurrency=3, progress=False)
    assert [r.request for r in res.results] == reqs  # in request order
    for r, q in zip(res.results, reqs):
        assert r.ok, r.error
        assert r.output_tokens == q.max_tokens == len(r.chunk_times)
        assert r.prompt_tokens == q.prompt_len
        assert r.text == "".join(f" t{i}" for i in range(q.max_tokens))
        assert len(r.itls) == q.max_tokens - 1
        # TPOT is the mean gap after the first token, from the same stamps
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / (q.max_tokens - 1))
        assert r.e2e >= r.ttft > 0
    body = fake.stats.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]


def test_chat_role_chunk_is_not_a_token(fake):
    res = load.run(Endpoint(fake.base_url, "fake-model", chat=True), [_req(2, 4)],
                   concurrency=1, progress=False)
    (r,) = res.results
    assert r.ok and r.output_tokens == 4 and len(r.chunk_times) == 4
    assert fake.stats.bodies[-1]["messages"][0]["role"] == "user"


def test_without_usage_tokens_are_text_events(fake):
    ep = Endpoint(fake.base_url, "fake-model", extra_body={"no_usage": True})
    (r,) = load.run(ep, [_req(2, 7)], concurrency=1, progress=False).results
    assert r.usage_output_tokens is None and r.output_tokens == 7


def test_http_and_stream_errors_are_failed_requests(fake):
    reqs = [BenchRequest("FAIL", 1, 4), BenchRequest("STREAMERR", 1, 6), _req(2, 3)]
    res = load.run(Endpoint(fake.base_url, "fake-model"), reqs, concurrency=3, progress=False)
    bad_http, bad_stream, good = res.results
    assert not bad_http.ok and "HTTP 500" in bad_http.error
    assert not bad_stream.ok and "boom" in bad_stream.error
    assert good.ok
    s = stats.summarize(res.results, res.duration_s)
    assert (s.completed, s.failed, s.output_tokens) == (1, 2, 3)


def test_api_key_is_sent():
    with FakeOpenAI(ttft_s=0.0, itl_s=0.0, api_key="sekret") as server:
        without = load.run(Endpoint(server.base_url, "m"), [_req()], concurrency=1,
                           progress=False).results[0]
        with_key = load.run(Endpoint(server.base_url, "m", api_key="sekret"), [_req()],
                            concurrency=1, progress=False).results[0]
    assert not without.ok and "HTTP 401" in without.error
    assert with_key.ok


def test_closed_loop_caps_clients():
    with FakeOpenAI(ttft_s=0.02, itl_s=0.005) as server:
        res = load.run(Endpoint(server.base_url, "m"), [_req(2, 3)] * 9, concurrency=3,
                       progress=False)
        assert server.stats.requests == 9 and server.stats.max_in_flight <= 3
    assert all(r.ok for r in res.results)


def test_open_loop_with_cap_and_schedule():
    with FakeOpenAI(ttft_s=0.01, itl_s=0.002) as server:
        res = load.run(Endpoint(server.base_url, "m"), [_req(2, 2)] * 6, rate=float("inf"),
                       concurrency=2, progress=False)
        assert server.stats.max_in_flight <= 2
        sched = load.run(Endpoint(server.base_url, "m"), [_req(2, 2)] * 3,
                         arrivals=[0.0, 0.01, 0.02], progress=False)
    assert all(r.ok for r in res.results + sched.results)
    sent = [r.sent for r in sched.results]
    assert sent == sorted(sent)  # sent in schedule order


# -- statistics on injected timelines -----------------------------------------------------
def test_timeline_derivations():
    r = _result(ttft=0.05, itl=0.01, tokens=11)
    assert r.ttft == pytest.approx(0.05)
    assert r.itls == pytest.approx([0.01] * 10)
    assert r.tpot == pytest.approx(0.01)
    assert r.e2e == pytest.approx(0.15)
    one = _result(ttft=0.05, itl=0.01, tokens=1)
    assert one.tpot is None and one.itls == []


def test_percentiles_match_numpy():
    assert stats.percentile(range(1, 101), 50) == pytest.approx(50.5)
    assert stats.percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert stats.percentile([], 50) is None
    rng = random.Random(7)
    xs = [rng.lognormvariate(0, 1) for _ in range(1001)]
    for p in (0, 50, 90, 99, 100):
        assert stats.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    with pytest.raises(ValueError):
        stats.percentile(xs, 101)


def test_ideal_cached_tokens_counts_whole_blocks_of_the_longest_shared_prefix():
    prompt = list(range(40))
    earlier = [list(range(20)) + [99], list(range(35)), [7] * 40]
    assert stats.ideal_cached_tokens(prompt, earlier, 16) == 32  # 35 shared: 2 whole blocks
    assert stats.ideal_cached_tokens(prompt, [prompt], 16) == 32  # never the last token
    assert stats.ideal_cached_tokens(list(range(33)), [list(range(40))], 16) == 32
    assert stats.ideal_cached_tokens(prompt, [], 16) == 0


def test_summary_throughput_and_latency_percentiles():
    results = [_result(ttft=0.01 * (i + 1), itl=0.001 * (i + 1), tokens=10) for i in range(100)]
    s = stats.summarize(results, duration_s=20.0)
    assert s.completed == 100 and s.failed == 0
    assert s.output_tokens == 1000 and s.prompt_tokens == 300
    assert s.output_throughput == pytest.approx(50.0)
    assert s.request_throughput == pytest.approx(5.0)
    assert s.total_token_throughput == pytest.approx(65.0)
    assert s.ttft.p50 == pytest.approx(0.505)
    assert s.ttft.p99 == pytest.approx(0.9901)
    assert s.tpot.p90 == pytest.approx(0.0901)
    assert s.itl.n == 900 and s.itl.max == pytest.approx(0.1)


def test_goodput_counts_requests_within_every_slo():
    results = [_result(ttft=0.1, itl=0.02, tokens=5),   # good
               _result(ttft=0.3, itl=0.02, tokens=5),   # TTFT too slow
               _result(ttft=0.1, itl=0.08, tokens=5),   # TPOT too slow
               _result(ttft=0.199, itl=0.049, tokens=5),  # just inside both limits: good
               _result(ttft=0.1, itl=0.5, tokens=1),    # one token: no TPOT, good
               _result(ttft=0.1, itl=0.01, tokens=5, ok=False)]  # failed
    s = stats.summarize(results, duration_s=2.0, slo_ttft=0.2, slo_tpot=0.05)
    assert s.good == 3
    assert s.goodput == pytest.approx(1.5)
    assert s.goodput_tokens == pytest.approx((5 + 5 + 1) / 2.0)
    assert s.slo_attainment == pytest.approx(3 / 6)
    only_ttft = stats.summarize(results, duration_s=2.0, slo_ttft=0.2)
    assert only_ttft.good == 4
    assert stats.summarize(results, duration_s=2.0).good == 5


def test_summary_by_tag():
    results = [_result(0.1, 0.01, 5, tag="short"), _result(1.0, 0.01, 2, tag="long")]
    s = stats.summarize(results, 1.0, tag="long")
    assert s.completed == 1 and s.ttft.p50 == pytest.approx(1.0)


# -- arrivals and datasets --------------------------------------------------------------
def test_poisson_arrivals_mean_gap_and_seed():
    t = load.poisson_arrivals(20000, rate=10.0, seed=3)
    gaps = np.diff([0.0] + t)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() == pytest.approx(0.1, rel=0.05)  # exponential: std == mean
    assert t == load.poisson_arrivals(20000, rate=10.0, seed=3)
    assert t != load.poisson_arrivals(20000, rate=10.0, seed=4)
    assert all(b > a for a, b in zip(t, t[1:]))
    assert load.poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        load.poisson_arrivals(3, 0)


def test_length_distributions():
    rng = random.Random(0)
    assert LengthDist.parse("64").sample(rng) == 64
    assert LengthDist.parse("fixed:32").sample(rng) == 32
    u = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(2000)]
    assert min(u) == 10 and max(u) == 20
    n = [LengthDist.parse("normal:200:20").sample(rng) for _ in range(4000)]
    assert statistics.mean(n) == pytest.approx(200, rel=0.02)
    assert statistics.stdev(n) == pytest.approx(20, rel=0.1)
    assert min(LengthDist.parse("normal:2:50").sample(rng) for _ in range(200)) >= 1
    for bad in ("x", "uniform:5", "uniform:9:3", "gamma:1:2"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_synthetic_lengths_and_prefix_groups():
    reqs = datasets.synthetic(30, LengthDist.parse("uniform:5:9"), LengthDist.parse("7"),
                              seed=1)
    assert all(len(r.prompt.split()) == r.prompt_len and 5 <= r.prompt_len <= 9 for r in reqs)
    assert all(r.max_tokens == 7 for r in reqs)
    assert reqs == datasets.synthetic(30, LengthDist.parse("uniform:5:9"),
                                      LengthDist.parse("7"), seed=1)
    grouped = datasets.synthetic(12, LengthDist.parse("4"), LengthDist.parse("2"), seed=0,
                                 prefix_groups=3, prefix_len=20)
    for r in grouped:
        assert r.prompt_len == 24 and len(r.prompt.split()) == 24
    heads = {g: {" ".join(r.prompt.split()[:20]) for r in grouped if r.group == g}
             for g in range(3)}
    assert all(len(h) == 1 for h in heads.values())  # one prefix per group
    assert len({next(iter(h)).split()[0] for h in heads.values()}) == 3  # differ at token 0


def test_synthetic_prompt_len_is_the_real_token_count(model_path):
    from core.tokenizer import Tokenizer

    tok = Tokenizer.load(model_path)
    reqs = datasets.synthetic(10, LengthDist.parse("uniform:50:300"), LengthDist.parse("1"),
                              seed=2, prefix_groups=2, prefix_len=64)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b c", "max_tokens": 4}\n\n{"prompt": "d"}\n')
    reqs = datasets.from_jsonl(path, default_max_tokens=9)
    assert [(r.prompt, r.max_tokens) for r in reqs] == [("a b c", 4), ("d", 9)]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        datasets.from_jsonl(tmp_path / "bad.jsonl")


# -- the command ------------------------------------------------------------------------
def test_tandem_bench_command(fake, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--base-url", fake.base_url, "--num-prompts", "6",
                   "--input-len", "uniform:3:6", "--output-len", "4", "--rate", "50,inf",
                   "--slo-ttft", "10000", "--slo-tpot", "10000", "--json", str(out),
                   "--plot-dir", str(tmp_path / "img"), "--label", "fake", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fake rate 50/s" in printed and "fake rate inf/s" in printed
    doc = json.loads(out.read_text())
    assert doc["config"]["model"] == "fake-model" and "api_key" not in doc["config"]
    assert len(doc["runs"]) == 2
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["output_tokens"] == 24 and s["good"] == 6
        assert [r["output_tokens"] for r in run["requests"]] == [4] * 6
    assert fake.stats.bodies[-1]["model"] == "fake-model"  # found through /v1/models
    pytest.importorskip("matplotlib")
    assert (tmp_path / "img" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "img" / "throughput_vs_rate.png").stat().st_size > 0


def test_bench_command_needs_a_load_shape(fake, capsys):
    assert cli.main(["bench", "--base-url", fake.base_url, "--num-prompts", "1"]) == 2
    assert "--rate" in capsys.readouterr().err


def test_format_table_lists_runs_side_by_side():
    a = stats.summarize([_result(0.1, 0.01, 5)], 1.0, slo_ttft=0.2)
    b = stats.summarize([_result(0.2, 0.02, 5)], 1.0, slo_ttft=0.2)
    table = report.format_table([("left", a), ("right", b)])
    assert "left" in table.splitlines()[0] and "right" in table.splitlines()[0]
    assert any(line.startswith("TTFT p50 (ms)") and "100.0" in line and "200.0" in line
               for line in table.splitlines())
    assert "goodput" in table


def test_vs_peers_names_the_cpu_and_runs_vllm_at_its_best_dtype(monkeypatch, tmp_path):
    """bench/vs_peers.py heads its output with the CPU's model and flags, and runs vLLM in
    bf16 only where the CPU computes bf16 in hardware (AVX512-BF16 or AMX), else fp32."""
    from bench import vs_peers

    cpuinfo = {"avx2": "flags\t: fpu avx2 fma sse4_2",
               "amx": "flags\t: avx2 fma amx_bf16 avx512_bf16"}
    real = vs_peers.Path
    for kind, want in (("avx2", False), ("amx", True)):
        f = tmp_path / kind
        f.write_text(f"model name\t: Test CPU {kind}\n{cpuinfo[kind]}\n")
        monkeypatch.setattr(vs_peers, "Path", lambda p, f=f: f if p == "/proc/cpuinfo" else real(p))
        line, bf16 = vs_peers.cpu_description()
        assert line.startswith(f"CPU: Test CPU {kind}; flags: avx2 fma")
        assert bf16 is want


def test_the_batch1_prompts_are_new_to_the_server():
    """vs_peers / vs_llamacpp / vs_hf time c1 TTFT as a cold prefill: the c1 prompts share
    not even their first words with the closed loop's (they were its first prompts, all
    prefix-cache hits), at the same lengths."""
    from argparse import Namespace

    from tandem.bench.script import batch1_requests, closed_loop_requests
    args = Namespace(num_prompts=64, batch1_prompts=4, prompt_len=128, output_len=64)
    loop, one = closed_loop_requests(args), batch1_requests(args)
    assert len(one) == 4 and {r.prompt_len for r in one} == {128}
    heads = {" ".join(r.prompt.split()[:4]) for r in loop}
    assert not {" ".join(r.prompt.split()[:4]) for r in one} & heads


LEAVER = """
import os, sys, time
pid = os.fork()
if pid == 0:  # the grandchild: burns 1.5 CPU-s after its parent is gone
    time.sleep(0.8)
    t = time.process_time()
    while time.process_time() - t < 1.5:
        pass
    os._exit(0)
print(pid, flush=True)
time.sleep(0.6)  # the grandchild is seen in our tree, then re-parented out of it
"""


def test_the_noise_meter_counts_a_helper_that_left_our_tree_as_ours():
    """A server's helper that outlives it (vLLM's engine core, re-parented to init when
    the server stops) burned CPU that the meter read as other processes': the vLLM runs
    of bench/vs_peers.py were flagged "disturbed" on a quiet machine."""
    import subprocess
    import sys

    from tandem.bench.servers import Noise
    noise = Noise().start()
    child = subprocess.run([sys.executable, "-c", LEAVER], capture_output=True, text=True,
                           timeout=30)
    assert child.returncode == 0, child.stderr
    grandchild = int(child.stdout)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{grandchild}"):
        time.sleep(0.1)  # until the grandchild has burned its 1.5 s and is gone
    assert noise.others_cpu_s() < 0.75, noise.report()
    noise.report()  # ends the measurement: the sampler thread stops
    noise.tree._thread.join(timeout=5)
    assert not noise.tree._thread.is_alive()
