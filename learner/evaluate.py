"""Held-out evaluation on learner rank 0: greedy decoding of the eval prompts with the published weights.

A plain (unsharded) HF copy of the model on rank 0 loads each evaluated version's full state dict
(already gathered for publication), so evaluation adds no collective. Greedy decoding, one left-padded
batch per ``batch_size`` prompts, scored with dapo.rewards (the actors' verifiers). This is the
learner's cheap in-run curve (``eval/accuracy``); ``dapo eval`` (vLLM, avg@k) is the thorough one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping

import torch

from dapo.config import DapoConfig


class Evaluator:
    def __init__(self, cfg: DapoConfig, model_path: Path, batch_size: int = 64) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dapo.data import build_dataset

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.dataset = build_dataset(cfg, "eval", self.tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        self.max_new_tokens = cfg.actor.max_response_tokens
        self.batch_size = batch_size

    @torch.no_grad()
    def evaluate(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
        from dapo.rewards import score

        t0 = time.perf_counter()
        self.model.load_state_dict(dict(state_dict), strict=False)
        pad = self.tokenizer.pad_token_id
        correct, lengths = [], []
        for start in range(0, len(self.dataset), self.batch_size):
            prompts = [self.dataset[i] for i in range(start, min(start + self.batch_size, len(self.dataset)))]
            width = max(len(p.prompt_token_ids) for p in prompts)
            ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(prompts):  # left padding: generation continues every row at the end
                ids[r, width - len(p.prompt_token_ids):] = torch.tensor(p.prompt_token_ids)
                mask[r, width - len(p.prompt_token_ids):] = 1
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                      do_sample=False, pad_token_id=pad,
                                      eos_token_id=self.model.generation_config.eos_token_id)
            for r, p in enumerate(prompts):
                resp = out[r, width:].tolist()
                if self.tokenizer.eos_token_id in resp:
                    resp = resp[:resp.index(self.tokenizer.eos_token_id) + 1]
                text = self.tokenizer.decode(resp, skip_special_tokens=True)
                _, acc, _ = score(p.data_source, text, p.ground_truth)
                correct.append(float(acc))
                lengths.append(len(resp))
        n = len(correct)
        return {"eval/accuracy": sum(correct) / n, "eval/response_length_tokens": sum(lengths) / n,
                "eval/num_prompts": float(n), "time/eval_s": time.perf_counter() - t0}
