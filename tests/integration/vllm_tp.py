"""Generate, load, generate with a real vLLM engine at a given tensor-parallel size; prints JSON:

    python tests/integration/vllm_tp.py MODEL_DIR TENSOR_PARALLEL_SIZE

``workers``: [pid, q/k/v rows held] per model worker. Phases (tokens, log-probs and per-token
versions of each): ``v0`` the checkpoint's weights; ``reloaded`` after loading weights that differ
from the checkpoint in every kind of sharded tensor (attention, MLP, embedding/lm_head) and in a
replicated one (norm); ``inflight`` a generate that loads the checkpoint back after the first
decoding step, keeping the KV cache.
"""

import json
import os
import sys
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
    print("RESULT " + json.dumps(out), flush=True)
    engine.close()
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine may abort in interpreter teardown; nothing is left to do
