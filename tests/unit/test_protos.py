"""The committed generated code matches protos/coordinator.proto, and imports as a package."""

from __future__ import annotations

from pathlib import Path

from protos import generate


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = generate.REPO_ROOT / rel
        assert committed.exists(), f"{rel} is missing: run `python -m protos.generate` and commit it"
        assert path.read_text() == committed.read_text(), (
            f"{rel} does not match protos/coordinator.proto: run `python -m protos.generate` and "
            f"commit the result")


def test_grpc_module_imports_pb2_from_package() -> None:
    from protos import coordinator_pb2, coordinator_pb2_grpc

    source = Path(coordinator_pb2_grpc.__file__).read_text()
    assert "from protos import coordinator_pb2" in source
    assert coordinator_pb2.DESCRIPTOR.package == "dapo.v1"
    services = coordinator_pb2.DESCRIPTOR.services_by_name
    assert set(services["Coordinator"].methods_by_name) == {
        "Register", "Heartbeat", "Lease", "ReturnLeases", "Leave", "ReportEval", "Status", "GetWeightInfo",
        "FetchWeights"}


def test_weight_range_request_roundtrip() -> None:
    from protos import coordinator_pb2 as pb

    req = pb.WeightRangeRequest(auth_token="t", version=3, offset_bytes=4096, length_bytes=0)
    back = pb.WeightRangeRequest.FromString(req.SerializeToString())
    assert (back.auth_token, back.version, back.offset_bytes, back.length_bytes) == ("t", 3, 4096, 0)
