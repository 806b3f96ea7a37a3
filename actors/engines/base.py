"""The engine interface: sample groups of responses with their log-probs, swap weights in place.

An engine knows token ids, not text: prompts come in as ids, samples go out as ids, and
tokenisation / detokenisation belong to the actor loop. Two implementations share this
interface and the same tests: ``VllmEngine`` (the default) and ``TorchEngine`` (a KV-cache
sampler over the HF model, for machines where vLLM cannot be installed).

Log-probs are those of the distribution actually sampled: temperature applied and, when
``top_p < 1``, renormalised over the nucleus (vLLM's ``processed_logprobs``). The learner's
importance weight ``pi_prox / mu`` needs exactly this ``mu``.

In-flight weight updates (``chunk_tokens``): every ``chunk_tokens`` decoding steps
``between_chunks()`` may load newer weights, and every token records the version whose weights
sampled it. By default (an engine with ``keeps_kv_across_loads``, as both real ones are) the
running sequences keep their KV cache across the load and continue: their context stays encoded
by the weights that were loaded when it was computed (PipelineRL's in-flight updates). With
``reprefill=True`` (and on an engine without that ability) generation instead stops after each
chunk and every continued sample is re-prefilled from prompt + tokens so far, so its whole
context is re-encoded with the weights that sample the next token: exact, and 20-50 % slower.

LoRA (an engine built with ``lora``, the learner's ``lora.*``): ``load_weights`` takes base weights
(plain HF names), adapter tensors (peft's file names, dapo.weights.is_adapter_tensor) or both; the
base is loaded first (once, when the actor joins), then the adapter, which becomes the version. The
torch engine swaps adapters in place, so in-flight updates work as with full weights. vLLM binds an
adapter to a request when the request is admitted and cannot change it inside a running request:
there every version is a new adapter, running requests finish with the adapter they started with,
and each token records that adapter's version (in-flight loads apply from the next request;
``reprefill`` re-admits continued samples, which then take the newest adapter).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from dapo.config.lora import LoraConfig
from dapo.weights import is_adapter_tensor
from dapo.wire import FINISH_REASONS


StopWhen = Callable[[list[int]], bool]
"""``stop_when(response token ids so far) -> bool``: end this sample now (see ``Engine.generate``)."""


@dataclass
class Sample:
    """One sampled response."""

    token_ids: list[int]
    """Response token ids (a final stop token included: the policy must learn to stop)."""
    logprobs: list[float]
    """Per token: log-prob of the sampled token under the tempered (and top-p) distribution."""
    versions: list[int]
    """Per token: the policy version whose weights sampled it."""
    finish_reason: str
    """``stop`` (a stop token was sampled) or ``length`` (max tokens reached: truncated)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs) == len(self.versions), (
            len(self.token_ids), len(self.logprobs), len(self.versions))
        assert self.finish_reason in FINISH_REASONS, self.finish_reason


@dataclass
class RawSample:
    """What a backend returns for one chunk of one sequence (no versions yet)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False
    """True when a stop token ended the sequence."""
    versions: list[int] | None = None
    """Per token: the version that sampled it, from engines that load weights mid-call
    (``keeps_kv_across_loads``); None: all tokens carry the version loaded after the call."""


class WeightLoadTimeout(TimeoutError):
    """The engine's model workers did not finish a weight load within its deadline. The engine is
    unusable afterwards (a worker may still answer the old call): close it and stop."""


class Engine(abc.ABC):
    """Generate groups of samples; load new weights in place; report the loaded version."""

    keeps_kv_across_loads = False
    """True when ``_sample`` takes ``every_steps`` / ``between_steps``: it calls
    ``between_steps()`` after every ``every_steps`` decoding steps while sequences are still
    running, keeps their KV cache across a load there, and fills ``RawSample.versions``."""

    def __init__(self, version: int = 0, lora: LoraConfig | None = None) -> None:
        self.version = version
        """Policy version of the loaded weights."""
        self.lora = lora if lora is not None and lora.enabled else None
        """The adapters this engine serves (None: full weights)."""
        self.base_loads = 0
        """Loads of full weights: every version without LoRA; with LoRA the base, once per join."""
        self.adapter_loads = 0

    # -- backend hooks -----------------------------------------------------------------------
    @abc.abstractmethod
    def _sample(self, sequences: list[list[int]], n: int, max_tokens: int, temperature: float,
                top_p: float, seed: int, *, stop_when: StopWhen | None = None) -> list[list[RawSample]]:
        """Sample ``n`` continuations of up to ``max_tokens`` tokens for each sequence; one also
        ends (``stopped``) as soon as ``stop_when(its tokens so far)`` is true."""

    @abc.abstractmethod
    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in place (HF parameter names)."""

    def _load_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve ``adapter`` (peft file names) as ``version`` from the next decoding step or request."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    def close(self) -> None:
        """Free the engine's resources (idempotent)."""

    # -- public interface --------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state_dict`` (HF names, full tensors; with LoRA base and/or adapter tensors) as policy
        ``version``."""
        adapter = {k: v for k, v in state_dict.items() if is_adapter_tensor(k)}
        base = {k: v for k, v in state_dict.items() if not is_adapter_tensor(k)} if adapter else state_dict
        if adapter and self.lora is None:
            raise ValueError("these weights are LoRA adapters (the learner trains with lora.rank > 0) but this engine "
                             "was built without LoRA: start the actor with the learner's lora.* settings")
        if self.lora is not None and not adapter:
            raise ValueError(f"this engine serves LoRA adapters (lora.rank={self.lora.rank}) but the weights hold none "
                             "(the learner trains full weights): start the actor with the learner's lora.* settings")
        if base:
            self._load(base)
            self.base_loads += 1
        if adapter:
            self._load_adapter(adapter, version)
            self.adapter_loads += 1
        self.version = version

    def generate(self, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float, seed: int, *, chunk_tokens: int | None = None,
                 between_chunks: Callable[[], None] | None = None, reprefill: bool = False,
                 stop_when: StopWhen | None = None) -> list[list[Sample]]:
        """Sample ``n`` responses per prompt; returns one list of ``n`` samples per prompt.

        ``seed``: the torch engine draws exactly the same samples for the same seed, weights and
        prompts; vLLM uses the seed it was built with (see VllmEngine._sample) and ignores it.

        ``chunk_tokens``: call ``between_chunks()`` (it may call ``load_weights``) after every
        ``chunk_tokens`` decoding steps while samples are still running. ``None``: never.
        ``reprefill``: re-prefill continued samples after each chunk instead of keeping their KV
        cache (see the module docstring).
        ``stop_when``: a sample also ends (finish reason ``stop``) as soon as ``stop_when(its
        response tokens so far)`` is true: a multi-turn environment's stop strings (the actor
        decodes; the engine knows only ids). Not with ``reprefill``.
        """
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError(f"generate needs non-empty prompts, got lengths {[len(p) for p in prompt_ids]}")
        if n < 1 or max_tokens < 1:
            raise ValueError(f"generate needs n >= 1 and max_tokens >= 1, got n={n}, max_tokens={max_tokens}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        if stop_when is not None and chunk_tokens is not None and (reprefill or not self.keeps_kv_across_loads):
            raise ValueError("stop_when needs the KV cache kept across in-flight loads (reprefill=False)")
        if chunk_tokens is not None and not reprefill and self.keeps_kv_across_loads:
            raw = self._sample(prompt_ids, n, max_tokens, temperature, top_p, seed, every_steps=chunk_tokens,
                               between_steps=between_chunks or (lambda: None), stop_when=stop_when)
            return [[Sample(r.token_ids, r.logprobs, r.versions, "stop" if r.stopped else "length") for r in group]
                    for group in raw]
        if stop_when is not None:
            raw = self._sample(prompt_ids, n, max_tokens, temperature, top_p, seed, stop_when=stop_when)
            return [[Sample(r.token_ids, r.logprobs, r.versions or [self.version] * len(r.token_ids),
                            "stop" if r.stopped else "length") for r in group] for group in raw]
        return self._generate_reprefill(prompt_ids, n, max_tokens, temperature, top_p, seed, chunk_tokens,
                                        between_chunks)

    def _generate_reprefill(self, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float,
                            top_p: float, seed: int, chunk_tokens: int | None,
                            between_chunks: Callable[[], None] | None) -> list[list[Sample]]:
        """Decode in chunks of ``chunk_tokens``; re-prefill every continued sample after each."""
        chunk = max_tokens if chunk_tokens is None else min(chunk_tokens, max_tokens)
        first = self._sample(prompt_ids, n, chunk, temperature, top_p, seed)
        # Flat state per sample: (prompt, tokens, logprobs, versions, stopped)
        flat = [(p, list(r.token_ids), list(r.logprobs), r.versions or [self.version] * len(r.token_ids), r.stopped)
                for p, group in zip(prompt_ids, first) for r in group]
        for chunk_index in range(1, -(-max_tokens // chunk)):
            open_ids = [i for i, s in enumerate(flat) if not s[4] and len(s[1]) < max_tokens]
            if not open_ids:
                break
            if between_chunks is not None:
                between_chunks()
            step = min(chunk, max_tokens - chunk_index * chunk)
            seqs = [flat[i][0] + flat[i][1] for i in open_ids]
            # A distinct seed per chunk: re-using one would replay the same noise stream.
            more = self._sample(seqs, 1, step, temperature, top_p, seed + 1_000_003 * chunk_index)
            for i, [r] in zip(open_ids, more):
                p, toks, lps, vers, _ = flat[i]
                flat[i] = (p, toks + r.token_ids, lps + r.logprobs,
                           vers + (r.versions or [self.version] * len(r.token_ids)), r.stopped)
        samples = [Sample(toks, lps, vers, "stop" if stopped else "length")
                   for _, toks, lps, vers, stopped in flat]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompt_ids))]


def stop_token_ids(model_path: str) -> list[int]:
    """The model's end-of-sequence ids (generation_config.json, else config.json)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        raise ValueError(f"model at {model_path} declares no eos_token_id (config.json or "
                         "generation_config.json); samples would never stop. Set eos_token_id there.")
    return [eos] if isinstance(eos, int) else list(eos)
