"""The embedded default's warm-up: scripted teacher, identifier augmentation, demonstrations."""

import json
import re

import numpy as np
import pytest

from mtrl_jax.chat import ChatFormat, train_tokenizer
from mtrl_jax.data.collection import Collection, Document, Task
from mtrl_jax.search.build import SearchSettings, make_environment
from mtrl_jax.search.env import SearchEnvConfig
from mtrl_jax.warmup import augment_identifiers, augmented_tasks, demonstration_tokens, parse_tool_weights, teacher_turns

TOOLS = ["bm25_search", "vector_search"]


def test_parse_tool_weights():
    np.testing.assert_allclose(parse_tool_weights("", TOOLS), [0.5, 0.5])
    np.testing.assert_allclose(parse_tool_weights("vector_search:3,bm25_search:1", TOOLS), [0.25, 0.75])
    np.testing.assert_allclose(parse_tool_weights("vector_search:1", TOOLS), [0.0, 1.0])
    for bad, message in [("web_search:1", "web_search:1"), ("bm25_search", "TOOL:WEIGHT"), ("bm25_search:x", "not a number"),
                         ("bm25_search:-1", ">= 0"), ("bm25_search:0", "weight 0")]:
        with pytest.raises(ValueError, match=f"warmup.teacher_tools.*{re.escape(message)}"):
            parse_tool_weights(bad, TOOLS)


def test_teacher_draws_tools_with_the_given_weights_whatever_the_question():
    rng = np.random.default_rng(0)
    probs = parse_tool_weights("vector_search:3,bm25_search:1", TOOLS)
    names = []
    for i in range(4000):
        policy = teacher_turns(rng, TOOLS, probs)
        text = policy([{"role": "user", "content": f"question {i}"}])
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call["arguments"] == {"query": f"question {i}"}
        names.append(call["name"])
        assert policy([{"role": "tool", "content": "results"}]) == "<answer></answer>"
    assert abs(names.count("vector_search") / len(names) - 0.75) < 0.03


def test_augment_identifiers_rewrites_only_words_with_digits():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        out = augment_identifiers("KX-4821 datasheet for project Puma-74", rng)
        words = out.split(" ")
        assert words[1:4] == ["datasheet", "for", "project"]
        assert re.fullmatch(r"[A-Z]{2}-\d{4}", words[0]) and re.fullmatch(r"[A-Z][a-z]{3}-\d{2}", words[4])
        seen.add(out)
    assert len(seen) == 50
    assert augment_identifiers("stainless tap for naval use", rng) == "stainless tap for naval use"
    variants = augmented_tasks(Task("c/lookup-3", "KX-4821 datasheet", {"d1": 2}, "c"), 2, rng)
    assert [v.task_id for v in variants] == ["c/lookup-3#aug0", "c/lookup-3#aug1"]
    assert all(v.qrels == {} and v.query.endswith(" datasheet") and v.query != "KX-4821 datasheet" for v in variants)
    assert augmented_tasks(Task("c/describe-0", "stainless tap for naval use", {}, "c"), 2, rng) == []


def test_tokenizer_splits_digits_one_per_token():
    tokenizer = train_tokenizer(["part KX-4821 in project 4821 and 4821 again"] * 50, 300)
    tokens = tokenizer.encode("KX-4821").tokens
    assert tokens[-4:] == ["4", "8", "2", "1"]
    assert tokenizer.decode(tokenizer.encode("KX-4821 d0667").ids) == "KX-4821 d0667"


def test_tokenizer_has_the_tool_tags_as_single_tokens():
    tokenizer = train_tokenizer(["a search for pumps"] * 50, 300)
    call = '<tool_call>\n{"name": "bm25_search"}\n</tool_call>'
    tokens = tokenizer.encode(call, add_special_tokens=False).tokens
    assert tokens[0] == "<tool_call>" and tokens[-1] == "</tool_call>"
    assert tokenizer.decode(tokenizer.encode(call, add_special_tokens=False).ids, skip_special_tokens=False) == call
    response = tokenizer.encode("<tool_response>\nx\n</tool_response>", add_special_tokens=False).tokens
    assert response[0] == "<tool_response>" and response[-1] == "</tool_response>"


def test_demonstration_masks_exactly_the_teacher_turns():
    docs = [Document(f"d{i}", f"title {i}", f"text about KX-48{i:02d} pumps") for i in range(20)]
    task = Task("c/lookup-0", "KX-4805 datasheet", {"d5": 2}, "c")
    env = make_environment(Collection("c", docs, [task]), SearchSettings(tools=("bm25_search",), top_k=2),
                           SearchEnvConfig(tool_prompt="compact"))
    texts = [d.text for d in docs] + ['<tool_call>\n{"name": "bm25_search", "arguments": {"query": "x"}}\n</tool_call>',
                                      "<answer></answer>"] * 20
    chat = ChatFormat(train_tokenizer(texts, 400))
    tokens, mask = demonstration_tokens(chat, env, task, teacher_turns(np.random.default_rng(0), ["bm25_search"]))
    assert len(tokens) == len(mask)
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(chat.decode(tokens[start:i]))
            start = None
    assert len(runs) == 2
    assert runs[0].endswith("<|im_end|>") and '"query": "KX-4805 datasheet"' in runs[0]
    assert runs[1] == "<answer></answer><|im_end|>"
