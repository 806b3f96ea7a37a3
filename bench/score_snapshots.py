"""Score weight snapshots after the runs that wrote them, every one with the same instrument: ``dapo
eval``'s (the actors' vLLM engine, k samples a held-out prompt, each scored by the run's reward
path), one engine for all snapshots (the weights reloaded between them, as an actor loads a version).

    .venv/bin/python bench/score_snapshots.py RUN/weights [RUN2/weights ...] --k 4 -- experiment=smollm2_arith

A snapshot folder is what ``learner.save_weights_every_steps`` writes (learner/snapshots.py), and
what bench/peer_trl.py's worker writes for the peer with the same function. For each root, the
scores go to ROOT/scores.jsonl, one line a snapshot: its step, when it was complete
(``unix_time_s``), avg@k, pass@k and the mean response length. Because no evaluation runs inside
either run, neither side's clock carries an instrument's cost (bench/vs_trl.py ``--instrument
offline``). The engine samples with the seed it was built with, so one command gives the same
scores again; a snapshot's samples depend on the snapshots scored before it in that command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness

harness.service_env()  # before torch / vllm are imported


def score(roots: list[Path], k: int, data: str | None, overrides: list[str], top_p: float = 1.0) -> dict[Path, list[dict]]:
    """{root: one score line per snapshot of root, in the order written}. ``data``: dapo eval's DATA,
    None for the config's held-out set (data.eval_path)."""
    from safetensors.torch import load_file

    from dapo.config import load_config

    from actors.evaluate import make_eval_engine, parse_args, prepare, run_eval
    from learner.snapshots import read_index

    snapshots = {root: read_index(root) for root in roots}
    first = next((s[0]["path"] for s in snapshots.values() if s), None)
    if first is None:
        raise SystemExit(f"no snapshots under {', '.join(map(str, roots))} (expected index.jsonl: learner/snapshots.py)")
    data = data or load_config(overrides).data.eval_path
    args = parse_args([first, data, *overrides, "--k", str(k), "--top-p", str(top_p)])
    inputs = prepare(args)
    engine = make_eval_engine(args, inputs)
    out: dict[Path, list[dict]] = {}
    try:
        version = 0
        for root, entries in snapshots.items():
            lines = []
            for entry in entries:
                version += 1
                engine.load_weights(load_file(Path(entry["path"]) / "model.safetensors"), version)
                t0 = time.perf_counter()
                report = run_eval(args, inputs, engine)
                overall = report["overall"]
                lines.append({"step": entry["step"], "unix_time_s": entry["unix_time_s"], "k": k,
                              "accuracy": overall["avg@k"], "pass@k": overall["pass@k"],
                              "num_samples": overall["num_samples"],
                              "response_length_tokens": overall["mean_response_length_tokens"],
                              "score_s": time.perf_counter() - t0})
                print(json.dumps({"root": str(root), **lines[-1]}), flush=True)
            (root / "scores.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            out[root] = lines
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roots", nargs="+", type=Path, help="snapshot roots (folders holding index.jsonl)")
    ap.add_argument("--k", type=int, default=4, help="samples per held-out prompt (default 4)")
    ap.add_argument("--data", default=None, help="held-out rows, as dapo eval's DATA (default: data.eval_path)")
    ap.add_argument("--top-p", type=float, default=1.0)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after --: config overrides, e.g. experiment=...
    args = ap.parse_args(argv[:split])
    score(args.roots, args.k, args.data, argv[split + 1:], args.top_p)


if __name__ == "__main__":
    main()
