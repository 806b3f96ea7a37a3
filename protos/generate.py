"""Regenerate the Python code of ``protos/*.proto``: ``python -m protos.generate``.

The generated files are committed (so installs need no grpc_tools); tests/unit/test_protos.py
regenerates into a temp dir and fails when the committed files no longer match the .proto.
Generation runs with ``-I <repo root>`` so the gRPC module imports ``from protos import
coordinator_pb2`` (a package import, not a top-level ``coordinator_pb2``).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_FILES = ("protos/coordinator.proto",)
GENERATED_FILES = ("protos/coordinator_pb2.py", "protos/coordinator_pb2_grpc.py", "protos/coordinator_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir`` (which then holds ``protos/…``); returns the written files."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *[str(REPO_ROOT / p) for p in PROTO_FILES]]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: args {args}")
    return [out_dir / p for p in GENERATED_FILES]


def main() -> int:
    for path in generate(REPO_ROOT):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
