"""HF config.json parsing."""
from __future__ import annotations

from pathlib import Path


def test_hf_config_reads_transformers5_rope_parameters() -> None:
    from engine.loader.hf_loader import hf_config

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    cfg = hf_config({**base, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}},
                    Path("m"))
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    cfg = hf_config({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear",
                                                 "factor": 2.0}}, Path("m"))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
