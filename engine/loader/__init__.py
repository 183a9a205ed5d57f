"""Weight loaders: a checkpoint on disk -> (ModelConfig, named fp32/bf16 tensors).
``load_checkpoint`` picks a loader by what the path is: a .gguf file or an HF
directory; each loader is imported only when its format is asked for."""
from __future__ import annotations

from pathlib import Path

from engine.loader.base import LoadedCheckpoint

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Raises FileNotFoundError / ValueError naming the path when it is not a model."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"unknown model format: {p} (expected a .gguf file or an HF "
                             "directory with config.json and *.safetensors)")
        from engine.loader.gguf_loader import load_gguf
        return load_gguf(p)
    if (p / "config.json").is_file():
        from engine.loader.hf_loader import load_hf_dir
        return load_hf_dir(p)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        from engine.loader.gguf_loader import load_gguf
        return load_gguf(ggufs[0])
    raise ValueError(f"unknown model format: {p} has no config.json and "
                     f"{'several' if ggufs else 'no'} .gguf files")
