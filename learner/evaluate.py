"""Held-out evaluation on learner rank 0 with the published weights, in a child process.

A plain (unsharded) HF copy of the model on rank 0 loads each evaluated version's full state dict
(already gathered for publication), so evaluation adds no collective. One sample per held-out
prompt at the actors' temperature (``actor.temperature``), with a fixed sampling seed, scored by
the function that scores training groups (``actor.reward_fn``; by default dapo.rewards' verifier
for the row's data_source), each call under ``actor.verifier_timeout_s``: the accuracy of the
policy that is being trained, not of its greedy mode (the warm-started tiny model is ~1.0 greedy
but ~0.2 sampled; RL's job is to close that gap). This is the learner's cheap in-run curve
(``eval/accuracy``); ``dapo eval`` (vLLM, avg@k) is the thorough one.

A process forked from the learner (before its services start threads) holds the copy and
samples: ``submit`` sends it the version's weights down a pipe as safetensors bytes (a copy: the
learner updates its own in place right after) and the child answers with the metrics as JSON. A
thread would share the learner's GIL: generation is mostly Python on a small model, and the training
step after each submission ran ~60 % slower with it (bench/RESULTS.md "dapo vs TRL"). One evaluation
at a time (one copy): ``submit`` waits for the previous one.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from dapo.config import DapoConfig, LoraConfig
from dapo.lora import apply_lora, load_adapter_
from dapo.evaluation import sampled_accuracy
from dapo.rewards import ScoreFn, load_reward_fn


PROCESS_NAME = "dapo-eval"
"""The evaluation process's name in ps/psutil."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
WAIT_SLICE_S = 1.0
"""How often a blocking ``result`` asks whether to give up the wait."""


class EvaluationFailed(RuntimeError):
    """The evaluation process raised or died; the message says which and how."""


class Evaluator:
    submits_before_publish = False
    """``submit`` copies the published weights and waits for the previous evaluation: after the
    publish, off the actors' path (learner/loop.py publish_version)."""

    def __init__(self, cfg: DapoConfig, model_path: Path, tokenizer: Any) -> None:
        from dapo.data import build_dataset

        # Here, a held-out set the scoring function cannot score, or a reward_fn that does not
        # import, stops the start-up (not the first evaluation).
        dataset = build_dataset(cfg, "eval", tokenizer)
        prompts = [dataset[i] for i in range(len(dataset))]
        score_fn = _with_deadline(load_reward_fn(cfg.actor.reward_fn), cfg.actor.verifier_timeout_s)
        # fork: the child starts with torch, transformers, the scoring function and the held-out set
        # loaded (a spawned one would import them again, ~2.5 s of CPU next to the run's start-up); it
        # loads the model itself.
        self._conn, child_end = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(
            target=_serve, args=(child_end, self._conn, str(model_path), tokenizer, prompts, score_fn,
                                 cfg.actor.max_response_tokens, cfg.actor.temperature, cfg.learner.seed, cfg.lora),
            name=PROCESS_NAME, daemon=True)
        # Signals blocked across the fork: one that arrives before the child has reset its handlers
        # (see _serve) waits for it instead of running the learner's StopFlag handler in the child.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child_end.close()
        self._pending: int | None = None
        self._results: dict[int, dict[str, float]] = {}

    def submit(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Evaluate ``state_dict`` as ``version`` in the background; ``result(version)`` has it."""
        from safetensors.torch import save

        self.wait()
        try:
            self._conn.send_bytes(json.dumps({"version": version}).encode())
            self._conn.send_bytes(save({name: t.detach().cpu().contiguous() for name, t in state_dict.items()}))
        except OSError:  # BrokenPipeError: the child is gone
            raise self._died(version) from None
        self._pending = version

    def result(self, version: int, *, block: bool = False,
               abandon: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
        """The metrics of a submitted version: None while it runs (``block``: wait for it, unless
        ``abandon()``, asked every WAIT_SLICE_S, turns true first: a SIGTERM must not wait out an
        evaluation of a real model, minutes of HF generate). Raises ``EvaluationFailed`` when the
        evaluation did."""
        if self._pending is not None and block:
            while not self._conn.poll(WAIT_SLICE_S):  # poll is also true at EOF: a dead child
                if abandon():
                    return None
            self._receive()
        elif self._pending is not None and self._conn.poll():
            self._receive()
        return self._results.pop(version, None)

    def wait(self) -> None:
        if self._pending is not None:
            self._receive()

    def close(self, timeout_s: float = 5.0) -> str:
        """End the child: EOF on its pipe (it finishes the evaluation in hand and exits 0), SIGKILL
        after ``timeout_s``. Returns how it ended, for the learner's stop line."""
        self._conn.close()
        self._proc.join(timeout=timeout_s)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(timeout=timeout_s)
            return f"evaluation process killed after {timeout_s:g} s"
        return f"evaluation process exited {self._proc.exitcode}"

    def _receive(self) -> None:
        try:
            reply = json.loads(self._conn.recv_bytes())
        except EOFError:
            raise self._died(self._pending) from None
        self._pending = None
        if "error" in reply:
            raise EvaluationFailed(f"evaluating version {reply['version']} failed: {reply['error']}")
        self._results[int(reply.pop("version"))] = reply

    def _died(self, version: int | None) -> EvaluationFailed:
        self._proc.join(timeout=5)
        return EvaluationFailed(f"the evaluation process died (exit code {self._proc.exitcode}) while evaluating "
                                f"version {version}; see the learner's log above for why")


class ScoreTimeout(Exception):
    """A scoring call ran past ``actor.verifier_timeout_s`` (scored incorrect and counted)."""


def _with_deadline(score_fn: ScoreFn, timeout_s: float) -> ScoreFn:
    """``score_fn`` interrupted after ``timeout_s`` by SIGALRM: the actors bound each call by killing
    their worker process; here, in the evaluation process's main thread, an alarm does it (a verifier
    stuck inside one C call runs on until it returns to Python)."""
    def expire(signum: int, frame: Any) -> None:
        raise ScoreTimeout(f"scoring took more than actor.verifier_timeout_s={timeout_s}")

    def timed(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return score_fn(data_source, response, ground_truth)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return timed


def _serve(conn: Connection, parent_end: Connection, model_path: str, tokenizer: Any, prompts: list,
           score_fn: ScoreFn, max_new_tokens: int, temperature: float, seed: int, lora: LoraConfig | None = None
           ) -> None:
    """The child: for each (version, weights) received, load and evaluate them, until EOF."""
    # First: the learner's stop handlers (StopFlag) came with the fork and would make the child ignore
    # SIGTERM (multiprocessing's exit hook terminate()s, then joins without a timeout); and while the
    # child holds the parent's end of the pipe, the parent's close() never reaches it as EOF.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    parent_end.close()
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from dapo.launch import die_with_parent, set_process_name

    die_with_parent()
    set_process_name(PROCESS_NAME)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    if lora is not None and lora.enabled:  # a LoRA run publishes adapters: the base is this model's own
        model = apply_lora(model, lora).eval()
    while True:
        try:
            version = json.loads(conn.recv_bytes())["version"]
            weights = load(conn.recv_bytes())
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            if lora is not None and lora.enabled:
                load_adapter_(model, weights)
            else:  # strict=False: the published dict omits the tied lm_head copy (it is the embedding).
                model.load_state_dict(weights, strict=False)
            # batch_size 128: the whole built-in held-out set in one generate call, half the decoding steps of 64.
            r = sampled_accuracy(model, tokenizer, prompts, score_fn=score_fn, max_new_tokens=max_new_tokens,
                                 temperature=temperature, batch_size=128, seed=seed)
        except Exception as exc:  # noqa: BLE001 - reported to the learner, which raises it
            conn.send_bytes(json.dumps({"version": version, "error": repr(exc)}).encode())
            continue
        conn.send_bytes(json.dumps({
            "version": version, "eval/accuracy": r.accuracy, "eval/response_length_tokens": r.mean_response_tokens,
            "eval/truncated_fraction": r.truncated_fraction, "eval/num_prompts": float(r.num_samples),
            "eval/verifier_errors": float(r.num_score_errors),
            "time/eval_s": time.perf_counter() - t0, "time/eval_done_unix_s": time.time()}).encode())
