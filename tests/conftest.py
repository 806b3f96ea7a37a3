"""Shared test setup: every test process (and every process it starts) runs with the service env."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))


def pytest_sessionstart(session):
    """Build the embedded tiny model once, before any test runs (a minute or two on a new
    machine): outside every test's timeout, and never by two test processes at once."""
    from dapo.models.tiny import ensure_tiny_model

    ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False)


@pytest.fixture(scope="session")
def random_tiny_model(tmp_path_factory) -> Path:
    """The embedded tiny architecture and tokenizer with random weights (no warm start: fast);
    enough to start a learner. Read-only for the tests that share it."""
    from dapo.models.tiny import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer()
    build_model(tok, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def one_gloo_rank(tmp_path):
    """A one-rank gloo process group for in-process trainer tests."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
