"""Pure-torch engine: a batched KV-cache sampler over the HF causal LM.

Used for small models (``actor.engine=auto``: the built-in tiny ones) and where vLLM cannot be
installed. Same interface and same guarantees as the vLLM engine: log-probs of the tempered (and
top-p renormalised) distribution that was sampled, stop tokens included in the response, in-place
weight loads. In-flight loads (``between_steps``) happen between two decoding steps and the batch
keeps its KV cache across them. Sequences are left-padded so that the last prompt token of every
row sits in the same column; positions come from the attention mask. Each prompt is encoded once
for its n samples, and a row that has stopped leaves the batch (its cache rows too).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from actors.engines.base import Engine, RawSample, StopWhen, stop_token_ids
from dapo.config.lora import LoraConfig
from dapo.lora import apply_lora, load_adapter_
from dapo.weights import base_param_name, is_adapter_tensor


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log_softmax of ``logits / temperature`` restricted to the top-p nucleus; [B, V] float32.

    Same rule as vLLM's ``apply_top_k_top_p_pytorch``: sort ascending, drop tokens whose
    cumulative probability is <= 1 - top_p, always keep the most likely one.
    """
    scaled = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, idx = scaled.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, idx, sorted_logits)
    return scaled.log_softmax(dim=-1)


def sample_tokens(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logp`` [B, V] by inverting its CDF with one uniform draw per row: the
    distribution of ``torch.multinomial`` at ~1/14 of its CPU time here (it draws V numbers per row).

    The CDF and the draw are float64 (53-bit uniforms): a float32 CDF's steps near 1 are multiples
    of 6e-8, so over a 151,936-token vocabulary a token of probability 2e-8 would get an empty step
    or a 6e-8 one (tail tokens never drawn, or drawn up to 50 % off) while mu (``logp``) reports its
    true probability. ``exp`` stays float32: each probability to ~1e-7 of itself; only the running
    sum needs float64. ``right=True`` never lands on a zero-probability token (outside the nucleus):
    its step is empty. A draw rounded up to the total takes the last non-empty step: the first index
    where the CDF reaches the total (found by a search; a pass over V would cost as much as the CDF)."""
    cdf = logp.exp().double().cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype) * total
    return torch.minimum(torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, total)).squeeze(1)


class TorchEngine(Engine):
    keeps_kv_across_loads = True

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len_tokens: int = 512,
                 seed: int = 0, version: int = 0, lora: LoraConfig | None = None) -> None:
        super().__init__(version, lora)
        from transformers import AutoModelForCausalLM

        self._stop_ids = torch.tensor(stop_token_ids(model_path))
        self._max_len = max_model_len_tokens
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        if self.lora is not None:  # the learner's adapter layers (B = 0: the base until the first adapter)
            self.model = apply_lora(self.model, self.lora)
        self.model.eval()

    @torch.inference_mode()
    def _sample(self, sequences: list[list[int]], n: int, max_tokens: int, temperature: float,
                top_p: float, seed: int, *, every_steps: int = 0,
                between_steps: Callable[[], None] | None = None,
                stop_when: StopWhen | None = None) -> list[list[RawSample]]:
        from transformers import DynamicCache

        longest = max(len(s) for s in sequences)
        if longest + max_tokens > self._max_len:
            raise ValueError(f"prompt of {longest} tokens + {max_tokens} new tokens exceeds "
                             f"model.max_model_len_tokens={self._max_len}; shorten the prompt or raise it")
        ids = torch.full((len(sequences), longest), int(self._stop_ids[0]), dtype=torch.long)  # pad: masked out
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, longest - len(s):] = torch.tensor(s)
            mask[i, longest - len(s):] = 1
        gen = torch.Generator().manual_seed(seed)
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Each prompt is encoded once; its KV cache and last logits are then copied to its n samples' rows.
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True).logits[:, -1].repeat_interleave(n, dim=0)
        cache.batch_repeat_interleave(n)
        mask, positions = mask.repeat_interleave(n, dim=0), positions.repeat_interleave(n, dim=0)
        rows = len(sequences) * n
        active = torch.arange(rows)  # the batch's rows -> output rows: finished rows leave the batch
        out_ids = torch.zeros((rows, max_tokens), dtype=torch.long)
        out_lps = torch.zeros((rows, max_tokens))
        lengths = torch.zeros(rows, dtype=torch.long)
        stopped = torch.zeros(rows, dtype=torch.bool)
        versions = []  # per step: the version that sampled it
        for step in range(max_tokens):
            if between_steps is not None and step and step % every_steps == 0:
                # May load weights in place (the cache keeps the old weights' KV). Outside inference
                # mode: tensors it creates (receive buffers) may be written in place later.
                with torch.inference_mode(False):
                    between_steps()
            versions.append(self.version)
            if step:
                logits = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                                    past_key_values=cache, use_cache=True).logits[:, -1]
            logp = nucleus_logprobs(logits, temperature, top_p)
            token = sample_tokens(logp, gen)
            out_ids[active, step], out_lps[active, step] = token, logp.gather(1, token[:, None]).squeeze(1)
            lengths[active] = step + 1
            done = torch.isin(token, self._stop_ids)
            if stop_when is not None:  # an environment's stop string ends the turn too
                done |= torch.tensor([not d and stop_when(out_ids[row, :step + 1].tolist())
                                      for row, d in zip(active.tolist(), done.tolist())], dtype=torch.bool)
            stopped[active[done]] = True
            if bool(done.all()):
                break
            if bool(done.any()):  # decode only the rows still running
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                active, token, mask, positions = active[keep], token[keep], mask[keep], positions[keep]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
        result = [RawSample(out_ids[i, :lengths[i]].tolist(), out_lps[i, :lengths[i]].tolist(), stopped=bool(stopped[i]),
                            versions=versions[:int(lengths[i])]) for i in range(rows)]
        return [result[i * n:(i + 1) * n] for i in range(len(sequences))]

    @torch.inference_mode()
    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        # state_dict(): persistent tensors only (no rotary inv_freq), lm_head.weight included
        # for tied models (it aliases the embedding, so copying it twice is harmless). With LoRA: the
        # base weights under the plain model's names.
        params = {base_param_name(k): v for k, v in self.model.state_dict().items() if not is_adapter_tensor(k)}
        missing = [k for k in params if k not in state_dict and not (
            k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        unknown = [k for k in state_dict if k not in params]
        if missing or unknown:
            raise ValueError(f"state dict does not match the model: missing {missing[:5]}, "
                             f"unknown {unknown[:5]}; expected the HF names of {type(self.model).__name__}")
        for name, tensor in state_dict.items():
            params[name].copy_(tensor)

    @torch.inference_mode()
    def _load_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        load_adapter_(self.model, adapter)  # in place: a running batch keeps its KV cache, as with full weights
