"""``model.path`` -> a model folder: a built-in model by its name (built once under
``run.cache_dir``), else a local HF folder.

Above the builders: ``dapo.models.tiny_long`` and ``dapo.models.tiny_calc`` fine-tune the model of ``dapo.models.tiny``,
and none knows another's name here (the layering test refuses import circles in ``dapo``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo.models import gguf_import
from dapo.models.tiny import BUILTIN_MODEL, ensure_tiny_model
from dapo.models.tiny_calc import BUILTIN_CALC_MODEL, ensure_calc_model
from dapo.models.tiny_long import BUILTIN_LONG_MODEL, ensure_long_model


def resolve_model_path(cfg: Any) -> Path:
    """The model folder of a ``DapoConfig``: ``builtin:tiny`` -> the cached tiny model (built
    under ``cfg.run.cache_dir`` with ``cfg.run.seed``), ``builtin:tiny-long`` and ``builtin:tiny-calc`` -> its
    long-task and calculator variants, a fetched built-in (``dapo.models.gguf_import.BUILTIN_GGUF``) -> its folder in the cache, else
    ``cfg.model.path`` itself. Fetching is ``dapo.launch.fetch.resolve_model_path``'s (it needs pip)."""
    path = cfg.model.path
    if path == BUILTIN_MODEL:
        return ensure_tiny_model(cfg.run.cache_dir, cfg.run.seed)
    if path == BUILTIN_LONG_MODEL:
        return ensure_long_model(cfg.run.cache_dir, cfg.run.seed)
    if path == BUILTIN_CALC_MODEL:
        return ensure_calc_model(cfg.run.cache_dir, cfg.run.seed)
    if path in gguf_import.BUILTIN_GGUF:
        if (folder := gguf_import.cached_builtin(cfg.run.cache_dir, path)) is None:
            raise ValueError(f"model.path {path!r} is not fetched into run.cache_dir={cfg.run.cache_dir} yet: "
                             f"`dapo run`, `dapo learner` and `dapo eval` fetch it on first use; or run "
                             f"`dapo model fetch {path} run.cache_dir={cfg.run.cache_dir}`.")
        return folder
    if path.startswith("builtin:"):
        known = ", ".join(repr(n) for n in (BUILTIN_MODEL, BUILTIN_LONG_MODEL, BUILTIN_CALC_MODEL,
                                            *gguf_import.BUILTIN_GGUF))
        raise ValueError(f"model.path {path!r} is not a known built-in model: expected {known} or a local HF "
                         f"model folder.")
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.path {path!r} is not an HF model folder (no config.json there): "
                         f"pass a local folder saved with save_pretrained, or {BUILTIN_MODEL!r}.")
    return folder
