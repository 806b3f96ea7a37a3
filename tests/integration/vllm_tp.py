"""Generate, load, generate with a real vLLM engine at a given tensor-parallel size; prints JSON:

    python tests/integration/vllm_tp.py MODEL_DIR TENSOR_PARALLEL_SIZE [HANG_LOAD_TIMEOUT_S]

``workers``: [pid, q/k/v rows held] per model worker. Phases (tokens, log-probs and per-token
versions of each): ``v0`` the checkpoint's weights; ``reloaded`` after loading weights that differ
from the checkpoint in every kind of sharded tensor (attention, MLP, embedding/lm_head) and in a
replicated one (norm); ``inflight`` a generate that loads the checkpoint back after the first
decoding step, keeping the KV cache.

With ``HANG_LOAD_TIMEOUT_S`` (TP > 1), then a weight load into the same engine's model workers made
to hang in ``reload_weights``, with that deadline: ``hang`` holds ``raised`` (``TYPE: MESSAGE`` of
what the load raised), ``load_s``, ``close_s`` (``engine.close()``), ``workers`` (the model worker
processes: this process's children but multiprocessing's resource tracker), ``alive`` (those still
running after the close) and ``version``. A load still running after ``WATCHDOG_S`` (no deadline at
all) prints ``HUNG``, kills the workers by pid and exits 1. One engine start serves both (CI's budget).
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()  # in-process engine core, 1 OMP thread, before vllm is imported

import torch  # noqa: E402

PROMPTS = [[5, 17, 33, 40, 41], [7, 8, 9]]


def perturbed(state: dict) -> dict:
    """Deterministic changes to sharded and replicated tensors (no RNG: same in every process)."""
    def bump(name, t):
        if "norm" in name:
            return t * 1.5
        if any(k in name for k in ("q_proj.weight", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj",
                                   "embed_tokens", "lm_head")):  # lm_head: tied, bumped as embed_tokens
            return t + 0.02 * torch.sin(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape)
        return t
    return {k: bump(k, v) for k, v in state.items()}


def worker_info(model) -> list[int]:
    """Runs in each model worker (vLLM pickles it by name): its pid and its rows of the fused
    q/k/v projection (at TP > 1 a shard of them)."""
    return [os.getpid(), model.model.layers[0].self_attn.qkv_proj.output_size_per_partition]


WATCHDOG_S = 120.0


def hang_reloads(worker) -> None:
    """Runs in each model worker (vLLM pickles it): its next ``reload_weights`` never returns."""
    worker.reload_weights = lambda *args, **kwargs: time.sleep(3600)


def is_alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watchdog(done: threading.Event) -> None:
    import psutil

    if not done.wait(WATCHDOG_S):
        print(f"HUNG: the load did not return within {WATCHDOG_S:g} s", flush=True)
        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(1)


def hung_load(engine, state: dict, timeout_s: float) -> dict:
    """A load into workers that never return from it, with a ``timeout_s`` deadline, then the close."""
    import psutil

    engine._load_timeout_s = timeout_s  # weights.sync_timeout_s; the loads above ran with the default
    engine._llm.collective_rpc(hang_reloads)
    workers = [c for c in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]
    done = threading.Event()
    threading.Thread(target=watchdog, args=(done,), daemon=True).start()
    version, t0 = engine.version, time.monotonic()
    try:
        engine.load_weights(state, version + 1)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        raised = f"{type(exc).__name__}: {exc}"
    load_s = time.monotonic() - t0
    done.set()
    t0 = time.monotonic()
    engine.close()
    return {"raised": raised, "load_s": load_s, "close_s": time.monotonic() - t0, "version_before": version,
            "version": engine.version, "workers": len(workers), "alive": [w.pid for w in workers if is_alive(w)]}


def dump(groups) -> list:
    return [{"tokens": s.token_ids, "logprobs": s.logprobs, "versions": s.versions} for g in groups for s in g]


if __name__ == "__main__":  # vLLM spawns its TP workers: they re-import this file
    from transformers import AutoModelForCausalLM

    from actors.engines import make_engine

    model_dir, tp = sys.argv[1], int(sys.argv[2])
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    engine = make_engine("vllm", model_dir, dtype="float32", max_model_len_tokens=64, seed=0, tensor_parallel_size=tp)
    out = {"workers": engine._llm.apply_model(worker_info)}
    gen = dict(n=2, max_tokens=6, temperature=1.0, top_p=1.0, seed=0)
    out["v0"] = dump(engine.generate(PROMPTS, **gen))
    engine.load_weights(perturbed(state), 1)
    out["reloaded"] = dump(engine.generate(PROMPTS, **gen))
    loads = iter([lambda: engine.load_weights(state, 2)])
    out["inflight"] = dump(engine.generate(PROMPTS, **gen, chunk_tokens=1,
                                           between_chunks=lambda: next(loads, lambda: None)()))
    if len(sys.argv) > 3:
        out["hang"] = hung_load(engine, state, float(sys.argv[3]))
    else:
        engine.close()
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine may abort in interpreter teardown; nothing is left to do
