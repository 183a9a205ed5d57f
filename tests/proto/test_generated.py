"""The committed generated code matches the .proto files (``python -m proto.build``)."""
from __future__ import annotations

from proto import build


def test_generated_code_is_current() -> None:
    stale = build.stale_files()
    assert not stale, "stale generated protobuf code, run `python -m proto.build`: " + ", ".join(stale)


def test_every_proto_generates_importable_modules() -> None:
    import importlib

    for path in build.proto_files():
        importlib.import_module(f"proto.{path.stem}_pb2")
        importlib.import_module(f"proto.{path.stem}_pb2_grpc")


def test_check_reports_stale_and_orphaned_files(tmp_path, monkeypatch, capsys) -> None:
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(build.PROTO_DIR, root / "proto", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(build, "ROOT", root)
    monkeypatch.setattr(build, "PROTO_DIR", root / "proto")
    assert build.main(["--check"]) == 0
    edited = next((root / "proto").glob("*_pb2.py"))
    edited.write_text(edited.read_text() + "# hand edit\n")
    (root / "proto" / "gone_pb2.py").write_text("")
    assert build.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"proto/{edited.name} (differs" in out and "proto/gone_pb2.py (no .proto" in out
