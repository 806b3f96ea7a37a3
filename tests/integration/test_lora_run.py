"""A LoRA run end to end on real processes: `dapo learner` on 2 FSDP2 ranks with lora.rank > 0 and two
production actor loops (tests/fake_actor.py, the fake engine on real weight fetches). Every version on
the wire is the adapters alone (a few % of the model here, < 1 % on SmolLM2); an actor that joins late
gets the base once and the newest adapter, never the versions in between; an actor without the
learner's lora.* settings refuses to start; the checkpoint exports as a merged model and a peft
adapter folder that peft itself reads to the same log-probs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.integration.test_learner import ROOT, TOKEN, Learner
from tests.procs import kill_tree

pytestmark = pytest.mark.slow
LORA = ("lora.rank=4", "lora.alpha=8")


def _wait_step(learner: Learner, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in learner.metrics()):
        assert learner.proc.poll() is None and time.monotonic() < deadline, learner.log.read_text()[-3000:]
        time.sleep(0.2)


def _actor_version(learner: Learner, pid: int, above: int, timeout_s: float = 120) -> int:
    """The weight version the actor of process ``pid`` reports, once it is above ``above``."""
    from actors.client import CoordinatorClient

    with CoordinatorClient(learner.grpc, TOKEN, 5.0) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            held = [a.weight_version for a in client.status().actors if a.actor_name.endswith(f":{pid}")]
            if held and held[0] > above:
                return held[0]
            assert learner.proc.poll() is None and time.monotonic() < deadline, learner.log.read_text()[-3000:]
            time.sleep(0.1)


@pytest.mark.timeout(420)
def test_adapters_on_the_wire_a_late_actor_loads_the_base_once_then_the_newest(tmp_path, random_tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    learner = Learner(tmp_path, random_tiny_model, *LORA, "learner.total_steps=0", "learner.lr=1e-2",
                      "learner.eval_every_steps=0", "learner.checkpoint_every_steps=0")
    actors = [learner.actor(tmp_path, "early", *LORA)]
    try:
        _wait_step(learner, 3)
        wrong = subprocess.run([sys.executable, "-m", "tests.fake_actor", "--learner", learner.grpc, "--token", TOKEN,
                                "--fetch-weights", "lora.rank=8"], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)
        assert wrong.returncode == 1 and "start the actor with the learner's lora.* overrides" in wrong.stderr
        actors.append(learner.actor(tmp_path, "late", *LORA))
        learner.wait_for_actors(2)
        first = _actor_version(learner, actors[1].pid, above=0)  # the late actor holds its first version
        _actor_version(learner, actors[1].pid, above=first + 1)  # and then has loaded two newer ones
        os.killpg(learner.proc.pid, signal.SIGTERM)
        assert learner.wait(120) == 0, learner.log.read_text()[-3000:]
        for a, name in zip(actors, ("early", "late")):
            assert a.wait(60) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for a in actors:
            kill_tree(a)
        kill_tree(learner.proc)
    records = learner.metrics()
    last = max(r["step"] for r in records)
    adapter_bytes = {r["weights/bytes"] for r in records if "weights/bytes" in r}
    model = AutoModelForCausalLM.from_pretrained(random_tiny_model)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert len(adapter_bytes) == 1 and adapter_bytes.pop() < 0.1 * full_bytes  # every version: the adapters alone
    [early], [late] = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("early", "late"))
    for report in (early, late):
        assert report["base_loads"] == 1 and report["adapter_loads"] == len(report["loaded"])
        assert report["fetches"][0]["base_fetches"] == 1 == report["fetches"][-1]["base_fetches"]
        assert report["loaded"] == sorted(set(report["loaded"]))
    # the late actor: base + the newest adapter at its join (no version before it), then adapters alone
    first = late["fetches"][0]
    assert late["loaded"][0] == first["version"] >= 3 and len(late["loaded"]) >= 2
    assert first["tensors"] > late["fetches"][-1]["tensors"] or late["fetches"][-1] is first
    # the run's last version as the actors loaded it = the merged export of the final checkpoint
    v = late["loaded"][-1]
    adapter = load_file(tmp_path / f"late.json.v{v}.safetensors")
    assert adapter and all(".lora_" in k for k in adapter)
    assert v == last, (v, last)
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "learner.export", str(learner.run_dir / "checkpoints" / f"step_{last}"),
                    str(out)], cwd=ROOT, check=True, timeout=120)
    from peft import PeftModel

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(random_tiny_model, dtype=torch.float32),
                                           out / "adapter").eval()  # peft's own reader of the adapter folder
    ids = torch.tensor([[1, 5, 9, 20, 33, 7, 2, 40]])
    with torch.no_grad():
        a, b = merged(ids).logits, peft_model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(random_tiny_model, dtype=torch.float32).eval()(ids).logits
    assert (a - b).abs().max() <= 1e-4 and (a - plain).abs().max() > 1e-3  # trained, and merged = base + adapter
    exported = load_file(out / "adapter" / "adapter_model.safetensors")
    for k, t in adapter.items():  # what the actor loaded (model.dtype on the wire) is the checkpoint's adapter
        torch.testing.assert_close(exported[k].to(t.dtype), t, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
