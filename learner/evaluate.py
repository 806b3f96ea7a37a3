"""Held-out evaluation on learner rank 0 with the published weights, in a background thread.

A plain (unsharded) HF copy of the model on rank 0 loads each evaluated version's full state dict
(already gathered for publication), so evaluation adds no collective. One sample per held-out
prompt at the actors' temperature (``actor.temperature``), with a fixed sampling seed, scored by
dapo.rewards: the accuracy of the policy that is being trained, not of its greedy mode (the
warm-started tiny model is ~1.0 greedy but ~0.2 sampled; RL's job is to close that gap). This is
the learner's cheap in-run curve (``eval/accuracy``); ``dapo eval`` (vLLM, avg@k) is the thorough one.

``submit`` copies the weights into the evaluation model (the learner may update its own in place
right after) and samples in a thread: an evaluation (about one training step of CPU on the embedded
default) runs while the learner waits for a batch, off its critical path. One at a time (one
evaluation model); ``submit`` waits for the previous one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from dapo.config import DapoConfig
from dapo.evaluation import sampled_accuracy


class Evaluator:
    def __init__(self, cfg: DapoConfig, model_path: Path, tokenizer: Any) -> None:
        from dapo.data import build_dataset

        self.cfg, self.model_path, self.tokenizer = cfg, model_path, tokenizer
        dataset = build_dataset(cfg, "eval", tokenizer)  # here: a bad held-out set stops the start-up
        self.prompts = [dataset[i] for i in range(len(dataset))]
        # Built by the first evaluation's thread: loading the model copy stays off the learner's
        # start-up path (the version-0 evaluation runs while the actors start generating).
        self.model: torch.nn.Module | None = None
        self._thread: threading.Thread | None = None
        self._results: dict[int, dict[str, float]] = {}
        self._error: BaseException | None = None

    def submit(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Evaluate ``state_dict`` as ``version`` in the background; ``result(version)`` has it."""
        self.wait()
        # Copied now: the learner updates its weights in place right after. strict=False: the
        # published dict omits the tied lm_head copy (it is the embedding).
        if self.model is None:
            weights = {name: t.detach().clone() for name, t in state_dict.items()}
        else:
            self.model.load_state_dict(dict(state_dict), strict=False)
            weights = None
        self._thread = threading.Thread(target=self._run, args=(version, weights), name="eval", daemon=True)
        self._thread.start()

    def _build(self, weights: Mapping[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation="sdpa")
        model.load_state_dict(dict(weights), strict=False)
        self.model = model.eval()

    def result(self, version: int, *, block: bool = False) -> dict[str, float] | None:
        """The metrics of a submitted version: None while it runs (``block``: wait for it). Raises
        what the evaluation raised."""
        if block:
            self.wait()
        if self._error is not None:
            raise self._error
        return self._results.pop(version, None)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        try:
            if weights is not None:
                self._build(weights)
            self._results[version] = self._sample()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the loop's thread by result()
            self._error = exc

    def _sample(self) -> dict[str, float]:
        t0, actor = time.perf_counter(), self.cfg.actor
        # batch_size 128: the whole built-in held-out set in one generate call, half the decoding steps of 64.
        r = sampled_accuracy(self.model, self.tokenizer, self.prompts, max_new_tokens=actor.max_response_tokens,
                             temperature=actor.temperature, batch_size=128, seed=self.cfg.learner.seed)
        return {"eval/accuracy": r.accuracy, "eval/response_length_tokens": r.mean_response_tokens,
                "eval/truncated_fraction": r.truncated_fraction, "eval/num_prompts": float(r.num_samples),
                "time/eval_s": time.perf_counter() - t0, "time/eval_done_unix_s": time.time()}
