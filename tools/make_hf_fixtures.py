"""Write tiny random HF checkpoints and their reference outputs into tests/fixtures/.

torch and transformers are used here and only here (install them with
``pip install -r tools/requirements-fixtures.txt``); the tests read the files written below
without importing torch.

    python -m tools.make_hf_fixtures            # write fixtures, then check our export
    python -m tools.make_hf_fixtures --check    # only check our export against transformers

LoRA: ``lora/reference.npz``, seeded adapters on qwen3_untied and the logits of the merged export in transformers.

Decoder fixtures (each < 1 MB, grouped-query attention, 2 layers):
  qwen2           q/k/v bias, untied head, top-level ``rope_theta``
  qwen3_tied      per-head q/k RMSNorm, tied embeddings (no ``lm_head.weight``), ``rope_parameters``
  qwen3_untied    per-head q/k RMSNorm, untied head, sharded (``model.safetensors.index.json``)
  llama           untied head, Llama-3 rope scaling, sharded
Each directory gets ``reference.npz`` with ``tokens``, ``attention_mask`` (row 1 right-padded) and
float32 ``logits`` from transformers.

Encoder fixture: ``bert_tiny`` (random BERT + WordPiece ``tokenizer.json``, sentence-transformers
layout) with ``reference.npz`` holding sentences' mean-pooled, L2-normalised embeddings.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import numpy as np

torch = transformers = None  # imported by main(), after the arguments are parsed (--help needs neither)

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def decoders() -> dict:
    """``{fixture: (transformers config class, its arguments, max shard size or None)}``."""
    return {
        "qwen2": (transformers.Qwen2Config, dict(COMMON, tie_word_embeddings=False, rope_theta=10000.0), None),
        "qwen3_tied": (
            transformers.Qwen3Config,
            dict(COMMON, head_dim=16, tie_word_embeddings=True, rope_theta=1e6),
            None,
        ),
        "qwen3_untied": (
            transformers.Qwen3Config,
            dict(COMMON, head_dim=8, tie_word_embeddings=False, rope_theta=1e6),
            "60KB",
        ),
        "llama": (
            transformers.LlamaConfig,
            dict(
                COMMON,
                tie_word_embeddings=False,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            "60KB",
        ),
    }


def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(3, 12)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, 7:] = 0  # right-padded row
    tokens[1, 7:] = 0
    return tokens, mask


def hf_logits(model, tokens, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def randomise(model, seed):
    """Random weights everywhere, norms included, so every tensor matters for parity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def write_decoders():
    tokens, mask = batch()
    for seed, (name, (cls, kwargs, shard)) in enumerate(decoders().items()):
        out = FIXTURES / name
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*"):
            old.unlink()
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32).eval()
        randomise(model, seed)
        model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}), safe_serialization=True)
        config = json.loads((out / "config.json").read_text())
        if name == "qwen2" and "rope_parameters" in config:  # exercise the legacy top-level form
            config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
            (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "generation_config.json").unlink(missing_ok=True)
        np.savez(out / "reference.npz", tokens=tokens, attention_mask=mask, logits=hf_logits(model, tokens, mask))
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {size / 1024:.0f} KiB, files {sorted(f.name for f in out.iterdir())}")


LORA_BASE, LORA_RANK, LORA_ALPHA = "qwen3_untied", 4, 8.0


def lora_adapters(cfg):
    """Seeded adapters for the ``LORA_BASE`` fixture, with B != 0 so that they act (``init_adapters`` starts
    B at zero): the arrays the LoRA fixture stores."""
    import jax

    from mtrl_jax.model import lora

    adapters = lora.init_adapters(cfg, jax.random.PRNGKey(7))
    rng = np.random.default_rng(7)
    return jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.05, x.shape).astype(np.float32), adapters)


def write_lora():
    """``tests/fixtures/lora/reference.npz``: adapters on the ``LORA_BASE`` fixture, and the logits transformers
    gives on ``batch()`` for the export with the adapters merged (``lora.merged_weights``)."""
    import jax

    from mtrl_jax.model import hf_io, lora

    model, base = hf_io.load_hf_checkpoint(FIXTURES / LORA_BASE)
    cfg = model.config.replace(lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA)
    adapters = lora_adapters(cfg)
    merged_cfg, merged = lora.merged_weights(cfg, lora.merge(base, jax.tree.map(jax.numpy.asarray, adapters)))
    tokens, mask = batch()
    out = FIXTURES / "lora"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_io.save_hf_checkpoint(hf_io.Transformer(merged_cfg), merged, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        logits = hf_logits(hf, tokens, mask)
    flat = {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(adapters)}
    np.savez(out / "reference.npz", tokens=tokens, attention_mask=mask, logits=logits, **flat)
    print(f"lora: {sum(f.stat().st_size for f in out.iterdir()) / 1024:.0f} KiB")


def write_bert():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    out = FIXTURES / "bert_tiny"
    out.mkdir(parents=True, exist_ok=True)
    words = (
        "the a of and to in is for on with what which how why search query document result vector "
        "lexical dense sparse retrieval ranking model agent tool answer paper claim protein cell"
    ).split()
    vocab = (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + words
        + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
        + list("abcdefghijklmnopqrstuvwxyz0123456789")
    )
    vocab_map = {w: i for i, w in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(vocab_map, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab_map["[CLS]"]), ("[SEP]", vocab_map["[SEP]"])]
    )
    tok.save(str(out / "tokenizer.json"))
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    torch.manual_seed(7)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    randomise(model, 7)
    model.save_pretrained(out, safe_serialization=True)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    sentences = [
        "What protein binds the cell?",
        "lexical search with a dense vector model",
        "a",
        "The agent ranks every document for the query and answers with the tool result xyz99",
    ]
    enc = [tok.encode(s) for s in sentences]
    length = min(32, max(len(e.ids) for e in enc))
    ids = np.zeros((len(enc), length), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(enc):
        n = min(len(e.ids), length)
        ids[i, :n], mask[i, :n] = e.ids[:n], 1
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    emb = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    np.savez(
        out / "reference.npz",
        sentences=np.array(sentences),
        input_ids=ids,
        attention_mask=mask,
        embeddings=emb.astype(np.float32),
    )
    print(f"bert_tiny: {sum(f.stat().st_size for f in out.iterdir()) / 1024:.0f} KiB")


def check_export():
    """Load each fixture with mtrl_jax, export it, and load the export with transformers."""
    from mtrl_jax.model import hf_io

    tokens, mask = batch()
    worst = 0.0
    for name in decoders():
        model, params = hf_io.load_hf_checkpoint(FIXTURES / name)
        with tempfile.TemporaryDirectory() as tmp:
            hf_io.save_hf_checkpoint(model, params, tmp)
            exported = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
            ref = np.load(FIXTURES / name / "reference.npz")["logits"]
            diff = np.abs(hf_logits(exported, tokens, mask) - ref)[mask.astype(bool)].max()
        worst = max(worst, diff)
        print(f"export {name}: transformers loads it, max |dlogit| vs original = {diff:.2e}")
    if worst > 1e-5:
        raise SystemExit(f"export check FAILED: max |dlogit| = {worst}")
    print("export check passed")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only run the export check")
    parser.add_argument("--only", choices=("decoders", "bert", "lora"), help="write this fixture alone, then check")
    args = parser.parse_args(argv)
    global torch, transformers
    import torch
    import transformers

    writers = {"decoders": write_decoders, "bert": write_bert, "lora": write_lora}
    if not args.check:
        for name, write in writers.items():
            if args.only in (None, name):
                write()
    check_export()


if __name__ == "__main__":
    main()
