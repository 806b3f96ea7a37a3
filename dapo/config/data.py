"""``data.*``: training and held-out prompts, and how rows render."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.config.base import _check


@dataclass(kw_only=True)
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
