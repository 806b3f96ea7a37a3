"""``learner.*``: the training service (FSDP2 ranks, optimizer, checkpoints, evaluation, logging)."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.config.base import _check


WANDB_RESUME = ("auto", "never", "must", "allow")


@dataclass(kw_only=True)
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
