"""`tandem prefill` and `tandem decode` share the engine's flags; a prefill worker has
its own default token budget and decode compilation (its steps carry no decode rows),
and --help says so."""
from __future__ import annotations

from engine.config import SchedulerConfig
from tandem.cli import build_parser
from tandem.worker_cli import PREFILL_DEFAULTS, worker_config

MODEL = ["--model", "/nonexistent/model.gguf"]


def _config(*argv: str):
    return build_parser().parse_args(list(argv))


def test_a_prefill_worker_runs_larger_chunks_by_default(monkeypatch) -> None:
    import tandem.worker_cli as wc

    # resolve_model would check the file (or fetch the default): the flags are tested
    monkeypatch.setattr(wc, "resolve_model", lambda args: args.model)
    prefill = worker_config(_config("prefill", *MODEL)).engine
    decode = worker_config(_config("decode", *MODEL)).engine
    assert prefill.scheduler.max_num_batched_tokens == PREFILL_DEFAULTS["max_num_batched_tokens"] == 2048
    assert decode.scheduler.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens == 512
    override = worker_config(_config("prefill", *MODEL, "--max-num-batched-tokens", "256"))
    assert override.engine.scheduler.max_num_batched_tokens == 256


def test_help_shows_each_roles_default() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for role, want in (("prefill", "2048"), ("decode", "512")):
        action = next(a for a in sub.choices[role]._actions
                      if a.dest == "max_num_batched_tokens")
        assert action.help.endswith(f"(default: {want})") and str(action.default) == want


def test_a_prefill_worker_compiles_no_decode_batches_it_never_runs(monkeypatch) -> None:
    """A prefill worker never runs a decode step: it compiles the smallest decode bucket
    only, per layer (one-graph buckets cost a restart 20 s), where a decode worker compiles
    up to --max-num-seqs with one-graph buckets up to 4 rows; both flags still override."""
    import tandem.worker_cli as wc

    monkeypatch.setattr(wc, "resolve_model", lambda args: args.model)
    prefill = worker_config(_config("prefill", *MODEL)).engine.compilation
    decode = worker_config(_config("decode", *MODEL)).engine.compilation
    assert (prefill.compile_max_batch, prefill.compile_graph_max_batch) == (1, 0)
    assert (decode.compile_max_batch, decode.compile_graph_max_batch) == (None, 4)
    asked = worker_config(_config("prefill", *MODEL, "--compile-max-batch", "8",
                                  "--compile-graph-max-batch", "2")).engine.compilation
    assert (asked.compile_max_batch, asked.compile_graph_max_batch) == (8, 2)
