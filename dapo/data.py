"""Prompt datasets: verl-format parquet / jsonl rows, prompt rendering, the built-in task.

Rows are dicts in the verl / DAPO schema: ``data_source`` (str, picks the verifier in
``dapo.rewards``), ``prompt`` (list of ``{"role", "content"}`` chat messages),
``reward_model.ground_truth`` (str), ``extra_info.index``, plus whatever else the file holds.
``load_rows`` reads ``.parquet`` (pyarrow) and ``.jsonl`` (one JSON object per line), and the
other containers and row schemas of ``dapo.formats`` (``datasets`` folders, GSM8K's
question/answer, TRL's prompt columns); ``builtin`` rows come from ``dapo.tasks.addition.make_builtin_rows``.

Rendering a row into prompt text (``render_prompt``), exactly:

- ``chat``: ``tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
  tokenize=False)``: all messages as given. With the tiny model's ChatML template a one-message
  row becomes ``"<|im_start|>user\\n" + content + "<|im_end|>\\n<|im_start|>assistant\\n"``.
- ``dapo``: the last user message's content is replaced by
  ``DAPO_PREFIX + problem + DAPO_SUFFIX`` (the DAPO release's template), then ``chat`` as above.
  ``problem`` is the content with any instruction already wrapped around it removed first, so
  that a row is never templated twice: a leading full ``DAPO_PREFIX`` (and trailing
  ``DAPO_SUFFIX``), else a leading ``"Solve the following math problem step by step."`` sentence
  (DAPO-Math-17k sample rows), a trailing ``BOXED_INSTRUCTION`` (AIME rows) -- each followed /
  preceded by its whitespace, which is stripped.
- ``raw``: the messages' contents joined with ``"\\n\\n"`` (no template, no special tokens).
- ``auto``: ``chat`` (files and the built-in task alike: the built-in task's own format is its
  bare problem ``"a+b"`` as the user message, rendered with the chat template).

Prompt token ids are ``tokenizer(text, add_special_tokens=False)["input_ids"]`` (the template
already holds the special tokens). With ``dedup`` a row whose rendered text equals an earlier
row's is dropped (DAPO-Math-17k repeats each prompt 100x); rows longer than
``max_prompt_tokens`` are dropped with a warning and counted. ``prompt_id`` is the row's index in
what remains (``PromptDataset``), stable for a given file and settings.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from dapo import envs, formats, rewards
from dapo.tasks import arith
from dapo.tasks import coding
from dapo.tasks import addition

log = logging.getLogger(__name__)

TEMPLATES = ("auto", "chat", "dapo", "raw")
BUILTIN = "builtin"
BUILTIN_LONG = "builtin:long"
"""The built-in task's long variant (``addition.make_chain_rows``: 272-430-token responses)."""
BUILTIN_ARITH = "builtin:arith"
"""Arithmetic questions in words for a real small model (``dapo.tasks.arith``, scored ``numeric``)."""
BUILTIN_CALC = "builtin:calc"
"""Two-digit products with a calculator tool (``addition.make_calc_rows``, multi-turn: ``dapo.envs.Calculator``)."""
BUILTIN_CODE = "builtin:code"
"""Small Python functions scored by unit tests in a sandbox (``coding.make_code_rows``: ``actors.code_env``)."""
BUILTIN_EVAL_SEED = 0
"""The built-in held-out set does not depend on ``run.seed``: eval numbers compare across runs."""

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the answer "
               "to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_SHORT_PREFIX = "Solve the following math problem step by step."
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class Prompt(NamedTuple):
    """One prompt of a ``PromptDataset``."""

    prompt_id: int
    prompt_token_ids: list[int]
    data_source: str
    ground_truth: str


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a dataset as verl rows, validated: a verl-format file, or any container and
    row schema ``dapo.formats`` reads (``datasets`` folders, shards, .json/.arrow; plain
    question/answer or TRL prompt columns, converted with the data source their answers imply)."""
    rows = formats.to_verl_rows(formats.read_records(path), where=str(path))
    for i, row in enumerate(rows):
        _validate_row(row, f"{path} row {i}")
    return rows


def _validate_row(row: Any, where: str) -> None:
    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: {what}; expected the verl schema (data_source: str, prompt: "
                          f"list of {{role, content}}, reward_model: {{ground_truth}}).")

    if not isinstance(row, dict):
        raise bad(f"row is a {type(row).__name__}, not an object")
    if not isinstance(row.get("data_source"), str):
        raise bad(f"data_source is {row.get('data_source')!r}")
    messages = row.get("prompt")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in messages)):
        raise bad(f"prompt is {messages!r:.200}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise bad(f"reward_model is {reward_model!r:.200}")


def strip_instructions(content: str) -> str:
    """The bare problem of a user message (see the module docstring, ``dapo`` template)."""
    text = content
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX):]
        if text.endswith(DAPO_SUFFIX):
            text = text[:-len(DAPO_SUFFIX)]
    elif text.startswith(DAPO_SHORT_PREFIX):
        text = text[len(DAPO_SHORT_PREFIX):]
    if text.rstrip().endswith(BOXED_INSTRUCTION):
        text = text.rstrip()[:-len(BOXED_INSTRUCTION)]
    return text.strip()


def render_prompt(row: dict[str, Any], tokenizer: Any, template: str) -> str:
    """The prompt text of ``row`` under ``template`` (see the module docstring)."""
    if template not in TEMPLATES:
        raise ValueError(f"prompt template {template!r} is unknown: expected one of {TEMPLATES}.")
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]  # a copy: edited below
    if template == "raw":
        return "\n\n".join(m["content"] for m in messages)
    if template == "dapo":  # the last user message wrapped in the DAPO template
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ValueError(f"prompt has no user message to wrap in the DAPO template: {messages!r:.200}")
        messages[last_user]["content"] = DAPO_PREFIX + strip_instructions(messages[last_user]["content"]) + DAPO_SUFFIX
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: set data.prompt_template=raw, or use a "
                         "model folder whose tokenizer_config/chat_template.jinja defines one.")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class PromptDataset:
    """Rendered, tokenized, optionally de-duplicated prompts; item ``i`` has ``prompt_id == i``."""

    def __init__(self, rows: list[dict[str, Any]], tokenizer: Any, *, template: str = "auto",
                 dedup: bool = True, max_prompt_tokens: int | None = None) -> None:
        self.num_rows = len(rows)
        self.duplicates_dropped = 0
        self.too_long_dropped = 0
        seen: set[str] = set()
        kept: list[tuple[dict[str, Any], str]] = []
        # Rendering is a pure function of the messages: render each distinct prompt once
        # (DAPO-Math-17k: 1.79M rows, 17.9K distinct prompts).
        rendered: dict[tuple[tuple[str, str], ...], str] = {}
        for row in rows:
            key = tuple((m["role"], m["content"]) for m in row["prompt"])
            text = rendered.get(key)
            if text is None:
                text = rendered[key] = render_prompt(row, tokenizer, template)
            if dedup:
                if text in seen:
                    self.duplicates_dropped += 1
                    continue
                seen.add(text)
            kept.append((row, text))
        ids = tokenizer([t for _, t in kept], add_special_tokens=False)["input_ids"] if kept else []
        self.rows: list[dict[str, Any]] = []
        self.texts: list[str] = []
        self._ids: list[list[int]] = []
        for (row, text), token_ids in zip(kept, ids):
            if max_prompt_tokens is not None and len(token_ids) > max_prompt_tokens:
                self.too_long_dropped += 1
                continue
            self.rows.append(row)
            self.texts.append(text)
            self._ids.append(list(token_ids))
        if self.too_long_dropped:
            log.warning("dropped %d prompts longer than data.max_prompt_tokens=%d tokens; raise it "
                        "(and model.max_model_len_tokens) to keep them", self.too_long_dropped,
                        max_prompt_tokens)
        if not self.rows:
            raise ValueError(f"no prompts left out of {self.num_rows} rows ({self.duplicates_dropped} "
                             f"duplicates, {self.too_long_dropped} longer than {max_prompt_tokens} "
                             f"tokens).")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, prompt_id: int) -> Prompt:
        if not 0 <= prompt_id < len(self.rows):
            raise IndexError(f"prompt_id {prompt_id} out of range: the dataset has {len(self.rows)} prompts.")
        row = self.rows[prompt_id]
        return Prompt(prompt_id, list(self._ids[prompt_id]), row["data_source"],
                      str(row["reward_model"]["ground_truth"]))


BUILTIN_TASKS = {BUILTIN: addition.make_builtin_rows, BUILTIN_LONG: addition.make_chain_rows, BUILTIN_ARITH: arith.make_rows,
                 BUILTIN_CALC: addition.make_calc_rows, BUILTIN_CODE: coding.make_code_rows}
"""Built-in dataset name -> ``make(split, n, seed)`` of its rows."""


def rows_for(path: str, split: str, cfg: Any) -> list[dict[str, Any]]:
    """Rows of ``path`` (a built-in task, or a file / folder / pattern ``load_rows`` reads);
    ``split`` picks the built-in task's split."""
    if path in BUILTIN_TASKS:
        make = BUILTIN_TASKS[path]
        if split == "train":
            return make("train", cfg.data.builtin_num_train_prompts, cfg.run.seed)
        return make("eval", cfg.data.builtin_num_eval_prompts, BUILTIN_EVAL_SEED)
    if path.startswith("builtin"):
        raise ValueError(f"dataset {path!r} is not a built-in task: expected one of {', '.join(BUILTIN_TASKS)}, "
                         "or a dataset file or folder.")
    return load_rows(path)


def build_dataset(cfg: Any, split: str, tokenizer: Any) -> PromptDataset:
    """The train (``data.train_path``) or eval (``data.eval_path``) dataset of a ``DapoConfig``.

    Every data_source must be scorable by ``actor.reward_fn`` (with the default, a verifier in
    dapo.rewards: ``rewards.UnknownDataSource`` otherwise, before any rendering): an unscorable row
    would otherwise score -1 in the actors, a run that looks like data too hard. A custom
    ``actor.reward_fn`` owns its sources, in training and held-out evaluation alike (both score
    with it).
    """
    return PromptDataset(checked_rows(cfg, split), tokenizer, template=cfg.data.prompt_template,
                         dedup=cfg.data.dedup_by_prompt, max_prompt_tokens=cfg.data.max_prompt_tokens)


def checked_rows(cfg: Any, split: str) -> list[dict[str, Any]]:
    """The rows of ``build_dataset``'s dataset, refused as it refuses them (an unreadable file, a row
    off the schema, a data_source nothing scores), before any tokenizer: what the launchers check
    before they start a process (``dapo.preflight``)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r} is unknown: expected train or eval.")
    path = cfg.data.train_path if split == "train" else cfg.data.eval_path
    rows = rows_for(path, split, cfg)
    sources = Counter(r["data_source"] for r in rows)
    # Rows of a multi-turn environment are scored by it (dapo.envs): no single-turn verifier needed.
    rewards.check_data_sources({s: n for s, n in sources.items() if not envs.env_spec(s, cfg.actor.env)},
                               f"data.{split}_path={path}", cfg.actor.reward_fn)
    multi_turn = sorted(s for s in sources if envs.env_spec(s, cfg.actor.env))
    if split == "eval" and multi_turn and cfg.learner.eval_every_steps and cfg.learner.eval_on != "actors":
        raise ValueError(f"data.eval_path={path}: data_source {', '.join(map(repr, multi_turn))} is multi-turn "
                         "(an environment answers its turns: dapo.envs), which only the actors run; set "
                         "learner.eval_on=actors, or learner.eval_every_steps=0")
    return rows


def field_values(rows: list[dict[str, Any]], path: str) -> list[str | None]:
    """Each row's value of the dotted field ``path`` (``extra_info.fact``) as text (JSON if it is not
    text), None where the row has no such field: the history keys of selective leasing
    (``algorithm.selective_history_key``)."""
    out: list[str | None] = []
    for row in rows:
        value: Any = row
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out.append(value if isinstance(value, str) or value is None else json.dumps(value, sort_keys=True))
    return out


def describe_keys(values: Sequence[str | None], path: str) -> str:
    """One line on how rows share histories by ``path`` (for the learner's start-up log)."""
    missing = sum(v is None for v in values)
    shared = len(set(v for v in values if v is not None))
    line = f"selective leasing: histories by {path}: {len(values) - missing} rows share {shared}"
    if missing:
        line += (f"; {missing} rows have no {path} and keep their own (check the field's name if that "
                 "is all of them)")
    return line


def inspect_main(file: str, rows: int, overrides: list[str]) -> None:
    """``dapo data inspect FILE``: print how the first ``rows`` rows render, and a summary."""
    from transformers import AutoTokenizer

    from dapo.config import load_config
    from dapo.models.registry import resolve_model_path

    try:  # a bad override, model path or file (ConfigError is a ValueError): the message says what to fix
        cfg = load_config(overrides)
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg)))
        ds = PromptDataset(rows_for(file, "train", cfg), tokenizer, template=cfg.data.prompt_template,
                           dedup=cfg.data.dedup_by_prompt, max_prompt_tokens=cfg.data.max_prompt_tokens)
    except (OSError, ValueError) as exc:
        print(f"dapo: {exc}", file=sys.stderr)
        raise SystemExit(2)
    for i in range(min(rows, len(ds))):
        p = ds[i]
        print(f"--- prompt_id {p.prompt_id}  data_source={p.data_source}  ground_truth={p.ground_truth!r}  "
              f"tokens={len(p.prompt_token_ids)}")
        print(ds.texts[i])
    lengths = [len(ds[i].prompt_token_ids) for i in range(len(ds))]
    sources = Counter(r["data_source"] for r in ds.rows)
    print("--- summary")
    print(f"file: {file}  template: {cfg.data.prompt_template}  model: {cfg.model.path}")
    print(f"rows: {ds.num_rows}  duplicates dropped: {ds.duplicates_dropped}  "
          f"longer than {cfg.data.max_prompt_tokens} tokens dropped: {ds.too_long_dropped}  prompts: {len(ds)}")
    print(f"prompt tokens: min {min(lengths)}  mean {sum(lengths) / len(lengths):.1f}  max {max(lengths)}")
    print("data sources (rows) -> what scores them:")
    for source, count in sources.most_common():
        print(f"  {source} ({count}) -> {scorer_of(source, cfg)}")
    try:  # what training would refuse (the learner's start-up check), after showing the rows
        rewards.check_data_sources({s: n for s, n in sources.items() if not envs.env_spec(s, cfg.actor.env)},
                                   f"file {file}", cfg.actor.reward_fn)
    except rewards.UnknownDataSource as exc:
        print(f"dapo: {exc}", file=sys.stderr)
        raise SystemExit(2)


def scorer_of(data_source: str, cfg: Any) -> str:
    """What scores ``data_source`` rows under ``cfg``, in words: its multi-turn environment, a custom
    ``actor.reward_fn``, or the verifier ``dapo.rewards`` picks (``NO VERIFIER`` when none does)."""
    if env := envs.env_spec(data_source, cfg.actor.env):
        return f"environment {env} (multi-turn)"
    if cfg.actor.reward_fn != rewards.SCORE_FN:
        return f"actor.reward_fn={cfg.actor.reward_fn}"
    try:
        return rewards.verifier_name(data_source)
    except rewards.UnknownDataSource:
        return "NO VERIFIER: training refuses these rows"


def convert_main(source: str, out: str, data_source: str | None, instruction: str, force: bool) -> None:
    """``dapo data convert IN OUT``: write ``IN`` (any container and schema ``dapo.formats`` reads) as
    verl rows to ``OUT`` (.parquet or .jsonl), then say what scores each data source."""
    target = Path(out)
    try:
        if target.suffix not in (".parquet", ".jsonl"):
            raise ValueError(f"OUT {out!r} has suffix {target.suffix!r}: expected .parquet or .jsonl (verl format).")
        if target.exists() and not force:
            raise ValueError(f"OUT {out!r} exists: pass --force to overwrite it, or choose another path.")
        rows = formats.to_verl_rows(formats.read_records(source), data_source=data_source, instruction=instruction,
                                    where=source)
        for i, row in enumerate(rows):
            _validate_row(row, f"{source} row {i}")
        if not rows:
            raise ValueError(f"{source} holds no rows.")
    except (OSError, ValueError) as exc:
        print(f"dapo data convert: {exc}", file=sys.stderr)
        raise SystemExit(2)
    target.parent.mkdir(parents=True, exist_ok=True)
    formats.write_rows(rows, target)
    sources = Counter(r["data_source"] for r in rows)
    print(f"wrote {len(rows)} verl rows to {out}; data sources (rows) -> verifier:")
    for name, count in sources.most_common():
        try:
            scorer = rewards.verifier_name(name)
        except rewards.UnknownDataSource:
            scorer = "NO VERIFIER in dapo.rewards: train with actor.reward_fn=module:function"
        print(f"  {name} ({count}) -> {scorer}")
    first = rows[0]
    print(f"row 0: ground_truth={first['reward_model']['ground_truth']!r}  prompt={first['prompt'][-1]['content'][:120]!r}")
