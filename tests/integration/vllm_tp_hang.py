"""A weight load into a TP=2 vLLM engine whose model workers hang in ``reload_weights``; prints
one JSON line:

    python tests/integration/vllm_tp_hang.py MODEL_DIR LOAD_TIMEOUT_S

``raised``: ``TYPE: MESSAGE`` of what the load raised; ``load_s``: how long it took; ``close_s``:
how long ``engine.close()`` took; ``workers``: the model worker processes (this process's children
but multiprocessing's resource tracker); ``alive``: those still running after the close. A load still running after ``WATCHDOG_S`` (no deadline at all) prints
``HUNG``, kills the workers by pid and exits 1.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()  # in-process engine core, 1 OMP thread, before vllm is imported

WATCHDOG_S = 120.0


def hang_reloads(worker) -> None:
    """Runs in each model worker (vLLM pickles it): its next ``reload_weights`` never returns."""
    worker.reload_weights = lambda *args, **kwargs: time.sleep(3600)


def is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watchdog(done: threading.Event) -> None:
    if not done.wait(WATCHDOG_S):
        print(f"HUNG: the load did not return within {WATCHDOG_S:g} s", flush=True)
        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(1)


if __name__ == "__main__":  # vLLM spawns its TP workers: they re-import this file
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engines.vllm_engine import VllmEngine

    model_dir, timeout_s = sys.argv[1], float(sys.argv[2])
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    engine = VllmEngine(model_dir, max_model_len_tokens=64, tensor_parallel_size=2, load_timeout_s=timeout_s)
    engine._llm.collective_rpc(hang_reloads)
    workers = [c for c in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]
    done = threading.Event()
    threading.Thread(target=watchdog, args=(done,), daemon=True).start()
    t0 = time.monotonic()
    try:
        engine.load_weights(state, 1)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        raised = f"{type(exc).__name__}: {exc}"
    load_s = time.monotonic() - t0
    done.set()
    t0 = time.monotonic()
    engine.close()
    out = {"raised": raised, "load_s": load_s, "close_s": time.monotonic() - t0, "version": engine.version,
           "workers": len(workers), "alive": [w.pid for w in workers if is_alive(w)]}
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine may abort in interpreter teardown; nothing is left to do
