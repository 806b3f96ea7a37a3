"""The code's shape, checked on the source with ``ast``: modules a reader takes in at a sitting, functions
that fit on a screen, and one fork between single-turn and multi-turn rows (actors/rollout.py).

- No product module (dapo/, actors/, learner/, protos/; generated protobuf code aside) is over
  ``MAX_MODULE_LINES`` lines, and no function over ``MAX_FUNCTION_LINES`` (docstring included).
- Rows become scored samples in ``actors/rollout.py`` only: elsewhere in actors/ (the engines aside)
  nothing calls an engine's ``generate`` or the episode driver ``run_episodes``, so the actor loop,
  its held-out evaluation and ``dapo eval`` cannot grow a path of their own again.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dapo", "actors", "learner", "protos")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 70
ROLLOUT_HOME = "actors/rollout.py"


def product_files() -> list[Path]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)
    assert any(p.as_posix().endswith("actors/rollout.py") for p in files)  # the walk found the tree
    return files


def long_functions(source: str, limit: int) -> list[str]:
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def rollout_forks(source: str, path: str) -> list[str]:
    """Calls that turn rows into samples outside the seam: ``x.generate(...)`` (not ``self``'s own
    method) and ``run_episodes(...)``, in actors/ outside the engines and ``ROLLOUT_HOME``."""
    if not path.startswith("actors/") or path.startswith("actors/engines/") or path == ROLLOUT_HOME:
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "generate" and not (isinstance(f.value, ast.Name) and f.value.id == "self"):
            found.append(f"{path}:{node.lineno} calls .generate")
        if isinstance(f, ast.Name) and f.id == "run_episodes" or isinstance(f, ast.Attribute) and f.attr == "run_episodes":
            found.append(f"{path}:{node.lineno} calls run_episodes")
    return found


def test_modules_and_functions_are_short():
    problems = []
    for p in product_files():
        text = p.read_text()
        lines = text.count("\n")
        rel = p.relative_to(ROOT).as_posix()
        if lines > MAX_MODULE_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        problems += [f"{rel}: {f}" for f in long_functions(text, MAX_FUNCTION_LINES)]
    assert not problems, "\n".join(problems)


def test_rows_become_samples_in_the_rollout_seam_only():
    problems = [f for p in product_files() for f in rollout_forks(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path,source,flagged", [
    ("actors/evaluate.py", "engine.generate(prompts, n=4)", True),
    ("actors/loop.py", "out = run_episodes(engine, rows, 2, pool)", True),
    ("actors/loop.py", "rollouts = self.generate(leases)", False),  # the actor's own stage
    ("actors/rollout.py", "engine.generate(prompts, n=4)", False),
    ("actors/engines/vllm_engine.py", "self.llm.generate(prompts)", False),
    ("learner/evaluate.py", "model.generate(ids)", False),  # the learner's own evaluator, HF generate
])
def test_rollout_fork_checker(path, source, flagged):
    assert bool(rollout_forks(source, path)) == flagged


def test_length_checker():
    body = "\n".join(f"    x = {i}" for i in range(70))
    assert long_functions(f"def f():\n{body}\n", 70) == ["f (71 lines, line 1)"]
    assert long_functions(f"def f():\n{body[:-10]}\n", 70) == []
