"""Generate the Python modules for every ``proto/*.proto`` file.

    python -m proto.build           # (re)write proto/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m proto.build --check   # exit 1 listing generated files that are stale

Run from the repository root: protoc gets ``-I.`` so generated code imports
``from proto import x_pb2``. ``--check`` regenerates into a temporary folder and
compares text, so it catches a .proto edited without regenerating, a generated
file edited by hand, and generated files whose .proto is gone.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto into ``out_dir``; return the files written
    (relative to ``out_dir``). Raises RuntimeError when protoc fails.

    protoc runs in a child process: grpc_tools' compiler carries its own
    protobuf/absl symbols, which crash a process that already loaded other
    copies (nixl_cu12 does), and a child keeps the caller's process clean."""
    protos = [p.relative_to(ROOT).as_posix() for p in proto_files()]
    if not protos:
        return []
    well_known = str(resources.files("grpc_tools") / "_proto")  # google/protobuf/*.proto
    args = [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"-I{well_known}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            *protos]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed (exit {done.returncode}) on {', '.join(protos)}:\n"
                           f"{done.stderr}")
    return sorted(p.relative_to(out_dir) for p in (out_dir / "proto").glob("*")
                  if p.name.endswith(GENERATED_SUFFIXES))


def committed_generated() -> set[Path]:
    return {p.relative_to(ROOT) for p in PROTO_DIR.glob("*")
            if p.name.endswith(GENERATED_SUFFIXES)}


def stale_files() -> list[str]:
    """Generated files that differ from a fresh protoc run, are missing, or
    have no .proto any more; empty when everything is current."""
    stale: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for rel in fresh:
            committed = ROOT / rel
            if not committed.exists():
                stale.append(f"{rel} (missing)")
            elif committed.read_text() != (Path(tmp) / rel).read_text():
                stale.append(f"{rel} (differs from {rel.parent / rel.name.split('_pb2')[0]}.proto)")
        for rel in sorted(committed_generated() - set(fresh)):
            stale.append(f"{rel} (no .proto generates it)")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale generated files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for line in stale:
            print(f"stale: {line}")
        if stale:
            print("run `python -m proto.build` from the repository root", file=sys.stderr)
            return 1
        print(f"proto: {len(proto_files())} .proto file(s), generated code up to date")
        return 0
    for orphan in sorted(committed_generated()):
        (ROOT / orphan).unlink()
    written = generate(ROOT)
    for rel in written:
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
