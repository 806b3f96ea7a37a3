"""Shared test setup: every test process (and every process it starts) runs with the service env."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
