"""The engine's flags as users know them. EngineConfig went from 28 flat fields to groups
by concern (engine/config.py); the CLI still makes one flat flag per field. The golden file
was written from the flat config before the change: every flag of it must still exist on
every command that takes engine flags, in the same order, with the same destination,
default, type, choices and --help text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import CompileConfig, EngineConfig
from tandem.cli import build_parser

GOLDEN = Path(__file__).with_name("engine_flags.json")
COMMANDS = ("generate", "prefill", "decode")
"""The commands whose parsers add EngineConfig's flags (tandem up passes them through)."""


def engine_flags(command: str, names: set[str]) -> list[dict]:
    """What a user sees of each engine flag of ``command``, in --help order."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return [{"flags": a.option_strings, "dest": a.dest, "default": repr(a.default),
             "type": getattr(a.type, "__name__", None), "choices": a.choices,
             "action": type(a).__name__, "metavar": a.metavar, "help": a.help}
            for a in sub._actions if a.dest in names]


def _as_in_this_environment(record: dict) -> dict:
    """The golden file was written under TANDEM_COMPILE=0 (the suite's default, which
    tests/conftest.py leaves to the environment); --compile's default follows it."""
    if record["dest"] != "compile":
        return record
    default = CompileConfig.compile
    return {**record, "default": repr(default),
            "help": record["help"].replace("(default: False)", f"(default: {default})")}


def test_every_engine_flag_reads_as_before() -> None:
    golden = json.loads(GOLDEN.read_text())
    names = {f.name for _, f in EngineConfig.flat_fields()}
    assert names == set(golden["names"])
    for command in COMMANDS:
        want = [_as_in_this_environment(r) for r in golden["commands"][command]]
        assert engine_flags(command, names) == want, command


def test_from_flat_fills_each_group_and_refuses_unknown_names() -> None:
    config = EngineConfig.from_flat(block_size=32, max_num_seqs=3, quantization="int8",
                                    speculative_method="ngram", compile_max_batch=4)
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.quant.quantization,
            config.spec.speculative_method, config.compilation.compile_max_batch) == \
        (32, 3, "int8", "ngram", 4)
    assert config.load == EngineConfig().load
    with pytest.raises(TypeError, match="EngineConfig has no field blocksize"):
        EngineConfig.from_flat(block_size=32, blocksize=16)


def test_compile_graph_max_batch_defaults_to_4_and_refuses_negatives() -> None:
    """--compile-graph-max-batch (default 4) is refused below 0, naming the flag."""
    assert EngineConfig.from_flat().compilation.compile_graph_max_batch == 4
    assert EngineConfig.from_flat(
        compile_graph_max_batch=0).compilation.compile_graph_max_batch == 0
    with pytest.raises(ValueError, match="--compile-graph-max-batch must be >= 0, got -1"):
        EngineConfig.from_flat(compile_graph_max_batch=-1)


def test_compile_graph_layers_defaults_to_off_and_refuses_negatives() -> None:
    """--compile-graph-layers (default 0: larger decode steps per layer) is refused below
    0, naming the flag."""
    assert EngineConfig.from_flat().compilation.compile_graph_layers == 0
    assert EngineConfig.from_flat(compile_graph_layers=10).compilation.compile_graph_layers == 10
    with pytest.raises(ValueError, match="--compile-graph-layers must be >= 0, got -2"):
        EngineConfig.from_flat(compile_graph_layers=-2)
