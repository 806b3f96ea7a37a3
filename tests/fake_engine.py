"""A model-free stand-in for the inference engine, for tests that run the production actor loop
(``actors.loop.Actor`` with the real CoordinatorClient, GroupPusher and weight paths).

``FakeEngine`` implements ``actors.engines.base.Engine``: only the backend hooks are fake, so
chunked generation, in-flight loads and per-token versions are the production code. Its "model"
is deterministic (the seed is ignored): sample j of prompt p has ``1 + (sum(p) + j) % max_tokens``
tokens; the first is RIGHT when j is even, or for every j when ``p[0]`` is a multiple of
``easy_every`` (a group all right: dynamic sampling drops it), else WRONG; the rest are
``(p[0] + t) % 100``. Token t's log-prob is ``-(t + 1) / 64``. ``FakeVerifier`` scores what
``decode`` makes of a response, in-process, with the interface the loop uses of
``actors.verifier.Verifier``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from actors.engines.base import Engine, RawSample
from actors.verifier import Verdict

RIGHT, WRONG = 11, 12
"""First token of every response: whether the fake model answered right."""


class FakeEngine(Engine):
    def __init__(self, *, easy_every: int = 0, hold: Callable[[], None] = lambda: None,
                 keep_weights: bool = False, lora=None) -> None:
        """``hold()`` runs before every backend call: a test's way to keep leases in generation.
        ``lora``: take LoRA base + adapter loads (dapo.config.LoraConfig), as a real engine would."""
        super().__init__(version=0, lora=lora)
        self.easy_every, self.hold, self.keep_weights = easy_every, hold, keep_weights
        self.loaded: list[int] = []
        """Every version loaded, in order."""
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        """With ``keep_weights``: a copy of every version loaded."""

    def _sample(self, sequences: list[list[int]], n: int, max_tokens: int, temperature: float,
                top_p: float, seed: int) -> list[list[RawSample]]:
        self.hold()
        return [[self._response(p, j, max_tokens) for j in range(n)] for p in sequences]

    def _response(self, prompt: list[int], j: int, max_tokens: int) -> RawSample:
        easy = self.easy_every > 0 and prompt[0] % self.easy_every == 0
        length = 1 + (sum(prompt) + j) % max_tokens
        tokens = [RIGHT if easy or j % 2 == 0 else WRONG] + [(prompt[0] + t) % 100 for t in range(1, length)]
        return RawSample(tokens, [-(t + 1) / 64 for t in range(length)], stopped=length < max_tokens)

    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        pass

    def _load_adapter(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        pass

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        super().load_weights(state_dict, version)
        self.loaded.append(version)
        if self.keep_weights:  # the state dict views a buffer the next fetch overwrites
            self.weights[version] = {k: v.clone() for k, v in state_dict.items()}


def decode(token_ids: list[int]) -> str:
    return "right" if token_ids[0] == RIGHT else "wrong"


class FakeVerifier:
    """+1 for a right answer, -1 for a wrong one."""

    num_errors = num_timeouts = 0

    def score_many(self, items: list[tuple[str, str, str]]) -> list[Verdict]:
        return [Verdict(1.0, True, text) if text == "right" else Verdict(-1.0, False, text) for _, text, _ in items]

    def close(self) -> None:
        pass
