"""dapo.evaluation: batched, left-padded generate agrees with a plain token-by-token loop, and the
verdicts are the given scoring function's."""

import pytest
import torch

from dapo.config import load_config
from dapo.data import build_dataset
from dapo.evaluation import sampled_accuracy
from dapo.models.registry import resolve_model_path
from dapo.rewards import UnknownDataSource, score


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config([])
    path = resolve_model_path(cfg)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [p for p in (build_dataset(cfg, "eval", tok)[i] for i in range(12))]
    return model, tok, prompts


def greedy_reference(model, tok, prompt, max_new_tokens):
    ids = list(prompt.prompt_token_ids)
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
    return out


def test_greedy_batched_eval_matches_unbatched_loop(tiny):
    model, tok, prompts = tiny
    max_new = 40
    ref = [greedy_reference(model, tok, p, max_new) for p in prompts]
    correct = sum(score(p.data_source, tok.decode(r, skip_special_tokens=True), p.ground_truth)[1]
                  for p, r in zip(prompts, ref))
    result = sampled_accuracy(model, tok, prompts, score_fn=score, max_new_tokens=max_new, temperature=0.0,
                              batch_size=5)
    assert result.num_samples == len(prompts)
    assert result.accuracy == correct / len(prompts)
    assert result.mean_response_tokens == sum(map(len, ref)) / len(prompts)
    assert result.truncated_fraction == sum(tok.eos_token_id not in r for r in ref) / len(prompts)


def test_sampled_eval_is_seeded_and_leaves_global_rng_alone(tiny):
    model, tok, prompts = tiny
    state = torch.random.get_rng_state()
    a = sampled_accuracy(model, tok, prompts, score_fn=score, max_new_tokens=40, temperature=1.0, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())
    b = sampled_accuracy(model, tok, prompts, score_fn=score, max_new_tokens=40, temperature=1.0, seed=3)
    assert a == b


def test_verdicts_come_from_score_fn_and_its_errors_are_counted(tiny):
    """Each response is scored by ``score_fn`` with its prompt's data_source and ground truth: a
    function that accepts even-length texts, raises on ground truths divisible by 3 and records
    its calls gives exactly the accuracy and error count computed from the greedy responses."""
    model, tok, prompts = tiny
    max_new = 40
    texts = [tok.decode(greedy_reference(model, tok, p, max_new), skip_special_tokens=True) for p in prompts]
    calls = []

    def score_fn(data_source, response, ground_truth):
        calls.append((data_source, response, ground_truth))
        if int(ground_truth) % 3 == 0:
            raise RuntimeError("verifier bug")
        return 1.0, len(response) % 2 == 0, ""

    result = sampled_accuracy(model, tok, prompts, score_fn=score_fn, max_new_tokens=max_new, temperature=0.0)
    assert calls == [(p.data_source, t, p.ground_truth) for p, t in zip(prompts, texts)]
    raised = [int(p.ground_truth) % 3 == 0 for p in prompts]
    accepted = sum(not r and len(t) % 2 == 0 for r, t in zip(raised, texts))
    assert 0 < sum(raised) < len(prompts) and 0 < accepted
    assert (result.accuracy, result.num_score_errors) == (accepted / len(prompts), sum(raised))

    def unknown(data_source, response, ground_truth):
        raise UnknownDataSource(f"nothing scores {data_source}")

    with pytest.raises(UnknownDataSource, match="nothing scores dapo_builtin"):
        sampled_accuracy(model, tok, prompts, score_fn=unknown, max_new_tokens=4, temperature=0.0)
