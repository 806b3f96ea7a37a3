"""Weight loads into a real vLLM engine (actors.engines.vllm_engine), with markers between phases
so that a test can tell which phase logged what:

    python tests/integration/vllm_reloads.py MODEL_DIR NUM_LOADS

``== loads``: NUM_LOADS correct loads (the norms scaled a little more each time);
``== missing``: one load without model.layers.0.mlp.down_proj.weight;
``== misshaped``: one load with that tensor one column short (prints ``raised: TYPE: MESSAGE``).
stderr is merged into stdout, so vLLM's log lines and the markers stay in order.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()  # in-process engine, 1 OMP thread, before vllm is imported
os.dup2(1, 2)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from actors.engines.vllm_engine import VllmEngine  # noqa: E402

TENSOR = "model.layers.0.mlp.down_proj.weight"


def mark(text: str) -> None:
    print(f"== {text}", flush=True)


model_dir, num_loads = sys.argv[1], int(sys.argv[2])
engine = VllmEngine(model_dir, max_model_len_tokens=128)
state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
mark("loads")
for version in range(1, num_loads + 1):
    engine.load_weights({k: v * (1 + 1e-3 * version) if "norm" in k else v for k, v in state.items()}, version)
    engine.generate([[5, 17, 33]], n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=version)
mark("missing")
engine.load_weights({k: v for k, v in state.items() if k != TENSOR}, num_loads + 1)
mark("misshaped")
try:
    engine.load_weights({**state, TENSOR: state[TENSOR][:, :-1]}, num_loads + 2)
    print("loaded without an error", flush=True)
except Exception as exc:  # noqa: BLE001 - the test reads what was raised
    print(f"raised: {type(exc).__name__}: {exc}", flush=True)
mark("end")
sys.stdout.flush()
os._exit(0)  # vLLM's in-process engine may abort in interpreter teardown; nothing is left to do
