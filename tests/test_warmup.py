"""The embedded default's warm-up: scripted teacher, identifier augmentation, demonstrations."""

import dataclasses
import json
import re

import numpy as np
import pytest

from mtrl_jax.chat import ChatFormat, train_tokenizer
from mtrl_jax.data.collection import Collection, Document, Task
from mtrl_jax.search.build import SearchSettings, make_environment
from mtrl_jax.search.env import SearchEnvConfig
from mtrl_jax.rollout.interfaces import EpisodeDriver
from mtrl_jax.coldstart.demonstrations import demonstration_tokens
from mtrl_jax.coldstart.settings import ColdStartSettings, parse_tool_weights, parse_top_k_weights
from mtrl_jax.coldstart.teacher import Teacher, augment_question, augmented_tasks, question_vocabulary, teacher_turns
from mtrl_jax.search.results import result_identifiers

TOOLS = ("bm25_search", "vector_search")


def sft(model_cfg, params, demos, log=None, should_stop=None, resume=None, **settings):
    """``supervised_warmup`` with ``ColdStartSettings(**settings)``."""
    from mtrl_jax.coldstart.sft import supervised_warmup

    return supervised_warmup(
        model_cfg, params, demos, ColdStartSettings(**settings), log=log, should_stop=should_stop, resume=resume
    )


def test_parse_tool_weights():
    np.testing.assert_allclose(parse_tool_weights("", TOOLS), [0.5, 0.5])
    np.testing.assert_allclose(parse_tool_weights("vector_search:3,bm25_search:1", TOOLS), [0.25, 0.75])
    np.testing.assert_allclose(parse_tool_weights("vector_search:1", TOOLS), [0.0, 1.0])
    for bad, message in [
        ("web_search:1", "web_search:1"),
        ("bm25_search", ":WEIGHT"),
        ("bm25_search:x", "not a number"),
        ("bm25_search:-1", ">= 0"),
        ("bm25_search:0", "weight 0"),
    ]:
        with pytest.raises(ValueError, match=f"warmup.teacher_tools.*{re.escape(message)}"):
            parse_tool_weights(bad, TOOLS)


def test_parse_top_k_weights():
    assert parse_top_k_weights("", 20)[0] == [None]
    values, probs = parse_top_k_weights("10:1, 1:3,2:1", 20)
    assert values == [1, 2, 10]
    np.testing.assert_allclose(probs, [0.6, 0.2, 0.2])
    for bad, message in [
        ("0:1", "K (an integer in 1..20):WEIGHT"),
        ("21:1", "'21:1'"),
        ("x:1", "'x:1'"),
        ("3", ":WEIGHT"),
        ("3:-1", ">= 0"),
        ("3:0", "weight 0"),
    ]:
        with pytest.raises(ValueError, match=f"warmup.teacher_top_k.*{re.escape(message)}"):
            parse_top_k_weights(bad, 20)


def test_teacher_asks_for_top_k_with_the_given_weights():
    rng = np.random.default_rng(0)
    top_ks, probs = parse_top_k_weights("1:3,10:1", 20)
    asked = []
    for i in range(2000):
        text = teacher_turns(rng, Teacher(TOOLS, top_ks=tuple(top_ks), top_k_probs=probs))(
            [{"role": "user", "content": "q"}]
        )
        asked.append(json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["top_k"])
    assert set(asked) == {1, 10} and abs(asked.count(1) / len(asked) - 0.75) < 0.03


def test_teacher_draws_tools_with_the_given_weights_whatever_the_question():
    rng = np.random.default_rng(0)
    probs = parse_tool_weights("vector_search:3,bm25_search:1", TOOLS)
    names = []
    for i in range(4000):
        policy = teacher_turns(rng, Teacher(TOOLS, tool_probs=probs))
        text = policy([{"role": "user", "content": f"question {i}"}])
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call["arguments"] == {"query": f"question {i}"}
        names.append(call["name"])
        assert policy([{"role": "tool", "content": "results"}]) == "<answer></answer>"
    assert abs(names.count("vector_search") / len(names) - 0.75) < 0.03


def test_augment_question_scrambles_identifiers_and_swaps_words():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        out = augment_question("KX-4821 datasheet for project Puma-74", rng)
        words = out.split(" ")
        assert words[1:4] == ["datasheet", "for", "project"]
        assert re.fullmatch(r"[A-Z]{2}-\d{4}", words[0]) and re.fullmatch(r"[A-Z][a-z]{3}-\d{2}", words[4])
        seen.add(out)
    assert len(seen) == 50
    assert augment_question("stainless tap for naval use", rng) == "stainless tap for naval use"
    variants = augmented_tasks(Task("c/lookup-3", "KX-4821 datasheet", {"d1": 2}, "c"), 2, rng)
    assert [v.task_id for v in variants] == ["c/lookup-3#aug0", "c/lookup-3#aug1"]
    assert all(v.qrels == {} and v.query.endswith(" datasheet") and v.query != "KX-4821 datasheet" for v in variants)
    assert augmented_tasks(Task("c/describe-0", "stainless tap for naval use", {}, "c"), 2, rng) == []

    tasks = [
        Task("c/describe-0", "stainless tap for naval use", {}, "c"),
        Task("c/lookup-0", "KX-4821 datasheet", {}, "c"),
    ]
    vocabulary = question_vocabulary(tasks)
    assert vocabulary == ["datasheet", "for", "naval", "stainless", "tap", "use"]
    outs = [augment_question("stainless tap for naval use", rng, vocabulary).split(" ") for _ in range(400)]
    assert all(len(o) == 5 and set(o) <= set(vocabulary) for o in outs)
    swapped = np.mean([a != b for o in outs for a, b in zip(o, "stainless tap for naval use".split(" "))])
    assert abs(swapped - 0.5 * 5 / 6) < 0.05  # half the words redrawn, one draw in six gives the same word
    assert all(
        o[0] == "stainless"
        for o in (augment_question("stainless KX-1", rng, vocabulary, 0.0).split(" ") for _ in range(20))
    )
    variants = augmented_tasks(tasks[0], 3, rng, vocabulary)
    assert len(variants) == 3 and all(set(v.query.split(" ")) <= set(vocabulary) for v in variants)


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
    env = make_environment(
        Collection("c", docs, [task]),
        SearchSettings(tools=("bm25_search",), top_k=2),
        SearchEnvConfig(tool_prompt="compact"),
    )
    texts = [d.text for d in docs] + [
        '<tool_call>\n{"name": "bm25_search", "arguments": {"query": "x"}}\n</tool_call>',
        "<answer></answer>",
    ] * 20
    chat = ChatFormat(train_tokenizer(texts, 400))
    tokens, mask = demonstration_tokens(
        EpisodeDriver(env, chat, 4096), task, teacher_turns(np.random.default_rng(0), Teacher(("bm25_search",)))
    )
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


def test_result_identifiers_are_the_shown_words_with_a_digit_not_in_the_question():
    output = (
        "bm25_search results for 'component of project Falcon-12':\n"
        "[1] d0007 | Project Falcon-12 | Key component: part KX-4821. Project Falcon-12 is a marine...\n"
        "[2] d0123 | Project Falcon-45 | Key component: part BQ-1002, delivered..."
    )
    assert result_identifiers(output, "component of project Falcon-12") == ["KX-4821", "Falcon-45", "BQ-1002"]
    assert result_identifiers("vector_search found no documents for 'x'.", "x") == []


def test_teacher_hops_with_the_given_probability_on_a_shown_identifier():
    tool_output = (
        "bm25_search results for 'q':\n[1] d1 | Project A-1 | part KX-4821.\n[2] d2 | Project B-2 | part QQ-1111."
    )
    hops, queries = 0, set()
    for i in range(2000):
        policy = teacher_turns(np.random.default_rng(i), Teacher(TOOLS, hop=0.3))
        first = policy([{"role": "user", "content": "component of project A-1"}])
        assert (
            json.loads(first.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["query"]
            == "component of project A-1"
        )
        messages = [
            {"role": "user", "content": "component of project A-1"},
            {"role": "assistant", "content": first},
            {"role": "tool", "content": tool_output},
        ]
        second = policy(messages)
        if second.startswith("<tool_call>"):
            hops += 1
            queries.add(
                json.loads(second.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["query"]
            )
            third = policy(
                messages + [{"role": "assistant", "content": second}, {"role": "tool", "content": tool_output}]
            )
            assert third == "<answer></answer>"  # at most one hop
        else:
            assert second == "<answer></answer>" and not policy.hops
    assert abs(hops / 2000 - 0.3) < 0.03
    assert queries == {"KX-4821", "B-2", "QQ-1111"}  # any shown identifier, at random; never the question's
    # no identifier shown: no hop
    policy = next(
        p for p in (teacher_turns(np.random.default_rng(i), Teacher(TOOLS, hop=1.0)) for i in range(10)) if p.hops
    )
    assert (
        policy(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "x"},
                {"role": "tool", "content": "bm25_search found no documents for 'q'."},
            ]
        )
        == "<answer></answer>"
    )


def test_teacher_hop_queries_and_the_other_tool():
    question = "which pumps does the Acme plant use"
    shown = "bm25_search results for 'q':\n[1] d1 | Acme plant | text.\n[2] d2 | Pumps of 1990 | text."
    call = lambda text: json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))  # noqa: E731
    expected = {
        "title": {"Acme plant", "Pumps of 1990"},
        "keywords": {"pumps Acme plant use"},
        "question": {question},
    }
    for hop_query, queries in expected.items():
        for hop_other in (False, True):
            seen, same_tool = set(), 0
            for i in range(200):
                policy = teacher_turns(
                    np.random.default_rng(i), Teacher(TOOLS, hop=1.0, hop_queries=(hop_query,), hop_other=hop_other)
                )
                first = policy([{"role": "user", "content": question}])
                messages = [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": first},
                    {"role": "tool", "content": shown},
                ]
                second = call(policy(messages))
                seen.add(second["arguments"]["query"])
                same_tool += second["name"] == call(first)["name"]
            assert seen == queries, (hop_query, seen)
            # "other": never the first search's tool; otherwise the second tool is drawn on its own (about half)
            assert same_tool == 0 if hop_other else 60 < same_tool < 140, (hop_query, hop_other, same_tool)


def test_teacher_hop_tools_other_needs_two_tools():
    from configs import default
    from mtrl_jax.coldstart.settings import coldstart_settings as warmup_settings

    config = default.get_config()
    with config.unlocked():
        config.warmup.teacher_hop_tools = "other"
    assert warmup_settings(config).teacher.hop_other
    with config.unlocked():
        config.search.tools = "bm25_search"
    with pytest.raises(ValueError, match="warmup.teacher_hop_tools='other' needs two tools"):
        warmup_settings(config)


def test_turn_ends_cut_demonstrations_after_their_nth_assistant_turn():
    from mtrl_jax.coldstart.masks import assistant_turns, turn_end

    mask = [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert [turn_end(mask, n) for n in (1, 2, 3, 4)] == [4, 7, 10, 10] and assistant_turns(mask) == 3


def test_a_hop_that_overflows_the_context_is_demonstrated_without_it():
    docs = [Document(f"d{i}", f"part KX-48{i:02d}", f"KX-48{i:02d} pumps for " + "water " * 30) for i in range(20)]
    task = Task("c/lookup-0", "pumps", {"d5": 2}, "c")
    env = make_environment(
        Collection("c", docs, [task]),
        SearchSettings(tools=("bm25_search",), top_k=5, max_doc_chars=200),
        SearchEnvConfig(tool_prompt="compact"),
    )
    chat = ChatFormat(train_tokenizer([d.text for d in docs] * 5, 400))
    policy = teacher_turns(np.random.default_rng(0), Teacher(("bm25_search",), hop=1.0))
    driver = EpisodeDriver(env, chat, 4096)
    long_tokens, _ = demonstration_tokens(driver, task, policy)
    assert chat.decode(long_tokens).count("assistant\n<tool_call>") == 2
    short = EpisodeDriver(env, chat, len(long_tokens) - 20)
    tokens, _ = demonstration_tokens(short, task, policy)
    assert chat.decode(tokens).count("assistant\n<tool_call>") == 1


# the assistant turns each step's view holds: 1 = cut after the first turn, 2 = after the second, 3 = whole
@pytest.mark.parametrize(
    "full_every,two_turn_every,expected",
    [
        (8, 2, [1, 2, 1, 2, 1, 2, 1, 3, 1, 2, 1, 2, 1, 2, 1, 3]),  # the default
        (8, 4, [1, 2, 1, 1, 1, 2, 1, 3, 1, 2, 1, 1, 1, 2, 1, 3]),
        (3, 0, [1, 1, 3, 1, 1, 3, 1, 1, 3, 1, 1, 3, 1, 1, 3, 1]),
        (4, 1, [2, 2, 2, 3, 2, 2, 2, 3, 2, 2, 2, 3, 2, 2, 2, 3]),
    ],
)
def test_the_warmup_schedule_picks_its_views_as_configured(monkeypatch, full_every, two_turn_every, expected):
    from mtrl_jax.coldstart import masks
    from mtrl_jax.coldstart import sft as warmup
    from mtrl_jax.model import ModelConfig

    seen = []

    def recording_step(model_cfg, tx, shared, *options):
        def step(params, opt_state, frozen, tokens, attention, loss_mask):
            mask = np.asarray(loss_mask)
            seen.append(max(masks.assistant_turns(list(row)) for row in mask))  # turns the view holds
            return params, opt_state, 0.0, True

        return step

    monkeypatch.setattr(warmup, "warmup_step", recording_step)
    monkeypatch.setattr(warmup, "on_mesh", lambda tree, mesh: tree)
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    # prompt, call, results, a second call (the hop), results, the answer: three assistant turns
    demo = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1])
    done = warmup.supervised_warmup(
        cfg,
        {"w": np.zeros(1)},
        [demo] * 4,
        ColdStartSettings(
            steps=16,
            batch_size=2,
            learning_rate=0.1,
            full_every=full_every,
            two_turn_every=two_turn_every,
            share_prefix=False,
        ),
        log=None,
    )
    assert done.step == 16 and seen == expected


@pytest.mark.slow
def test_supervised_warmup_learns_demonstrations_of_mixed_lengths():
    import jax

    from mtrl_jax.model import ModelConfig, init_params

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    rng = np.random.default_rng(0)
    demos = []
    for i in range(40):  # prompt, a first turn to learn (7, 8, 9), a long or short tool block, a last turn (5)
        prompt = list(rng.integers(10, 60, size=6))
        block = list(rng.integers(10, 60, size=150 if i % 4 == 0 else 10))
        demos.append((prompt + [7, 8, 9] + block + [5], [0] * 6 + [1] * 3 + [0] * len(block) + [1]))
    common = dict(steps=80, batch_size=8, learning_rate=1e-2, log=None, full_every=2, full_bucket=32)
    done = sft(cfg, init_params(cfg, jax.random.PRNGKey(0)), demos, **common)
    losses = done.losses
    assert done.step == 80 and len(losses) == 80 and np.isfinite(losses).all()
    assert np.mean(losses[:4]) > 3.0 and np.mean(losses[-10:]) < 0.1


@pytest.mark.slow
def test_a_stopped_warmup_continues_exactly():
    import jax

    from mtrl_jax.model import ModelConfig, init_params

    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    rng = np.random.default_rng(1)
    demos = [(list(rng.integers(3, 30, size=12)), [0] * 4 + [1] * 8) for _ in range(10)]
    common = dict(steps=12, batch_size=4, learning_rate=1e-2, log=None, full_every=3, full_bucket=16)
    done = sft(cfg, init_params(cfg, jax.random.PRNGKey(0)), demos, **common)
    # stopped at step 5 (SIGTERM) and continued from its progress: exactly the same run
    calls = iter(range(1000))
    stopped = sft(cfg, init_params(cfg, jax.random.PRNGKey(0)), demos, should_stop=lambda: next(calls) >= 5, **common)
    assert stopped.step == 5 and len(stopped.losses) == 5
    resumed = sft(cfg, init_params(cfg, jax.random.PRNGKey(1)), demos, resume=stopped, **common)
    assert resumed.step == 12 and resumed.losses == done.losses
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.params, done.params)


def test_common_prefix_stops_before_the_first_trained_token_and_leaves_a_token():
    from mtrl_jax.coldstart.sft import common_prefix

    demos = [([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), ([1, 2, 3, 9], [0, 0, 0, 1]), ([1, 2, 3, 4, 6, 7], [0, 0, 1, 1, 1, 1])]
    assert common_prefix(demos) == [1, 2]  # the third trains on its third token
    assert common_prefix([([1, 2], [0, 0]), ([1, 2], [0, 1])]) == [1]  # each keeps a token
    assert common_prefix([([4, 2], [0, 1]), ([5, 2], [0, 1])]) == []


@pytest.mark.slow
def test_a_warmup_sharing_the_common_prefix_trains_as_one_that_does_not():
    """The system prompt every demonstration opens with is computed once per step: same losses and
    parameters as computing it in every row (to float rounding)."""
    import jax

    from mtrl_jax.model import ModelConfig, init_params
    from mtrl_jax.coldstart.sft import common_prefix

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    rng = np.random.default_rng(0)
    system = list(rng.integers(10, 60, size=12))
    demos = []
    for i in range(24):  # the shared prompt, a question, a first turn, a tool block of two lengths, a last turn
        question = list(rng.integers(10, 60, size=3 + i % 3))
        block = list(rng.integers(10, 60, size=40 if i % 4 == 0 else 6))
        demos.append(
            (system + question + [7, 8, 9] + block + [5], [0] * (12 + len(question)) + [1] * 3 + [0] * len(block) + [1])
        )
    assert common_prefix(demos) == system  # what the shared path computes once
    common = dict(
        steps=6, batch_size=4, learning_rate=1e-2, log=None, full_every=2, full_bucket=64
    )  # one whole-row shape
    runs = [
        sft(cfg, init_params(cfg, jax.random.PRNGKey(0)), demos, share_prefix=share, **common)
        for share in (True, False)
    ]
    np.testing.assert_allclose(runs[0].losses, runs[1].losses, rtol=2e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5), runs[0].params, runs[1].params
    )


def _bm25_teacher(env, chat, tasks, **settings):
    """The fields ``demonstrations`` reads, for a teacher that makes one BM25 search for 2 results."""
    import types

    from mtrl_jax.coldstart.settings import ColdStartSettings

    teacher = Teacher(("bm25_search",), tool_probs=(1.0,), top_ks=(2,), top_k_probs=(1.0,), hop_tool_probs=(1.0,))
    return types.SimpleNamespace(
        warmup=ColdStartSettings(steps=1, batch_size=1, learning_rate=0.0, teacher=teacher, **settings),
        run=types.SimpleNamespace(seed=0),
        env=env,
        chat=chat,
        collector=types.SimpleNamespace(max_len=4096, max_tokens_per_turn=256),
        train_tasks=tasks,
    )


def test_hop_drills_force_the_hop_and_leave_its_decision_untrained():

    from mtrl_jax.coldstart.demonstrations import demonstrations
    from mtrl_jax.coldstart.masks import assistant_turns, turn_end

    docs = [
        Document(f"d{i}", f"Project P-{i}", f'Key component: part "KX-48{i:02d}". Project P-{i} pumps')
        for i in range(20)
    ]
    tasks = [Task(f"c/multihop-{i}", f"component of project P-{i}", {f"d{i}": 1}, "c") for i in range(6)]
    env = make_environment(
        Collection("c", docs, tasks),
        SearchSettings(tools=("bm25_search",), top_k=2),
        SearchEnvConfig(tool_prompt="compact"),
    )
    chat = ChatFormat(
        train_tokenizer(
            [d.text for d in docs] * 5
            + [
                '<tool_call>\n{"name": "bm25_search", "arguments": {"query": "x", "top_k": 2}}\n</tool_call>',
                "<answer></answer>",
            ]
            * 20,
            400,
        )
    )

    def demos(drills):
        return demonstrations(_bm25_teacher(env, chat, tasks, hop_drills=drills))

    plain = demos(0)
    assert len(plain) == 6 and all(assistant_turns(m) == 2 for _, m in plain)  # the teacher never hops on its own
    drilled = demos(2)
    assert len(drilled) == 18 and sum(assistant_turns(m) == 3 for _, m in drilled) == 12
    for tokens, mask in drilled:
        if assistant_turns(mask) == 2:
            continue
        second = next(
            i for i in range(turn_end(mask, 1), len(mask)) if tokens[i] == chat.tokenizer.token_to_id("<tool_call>")
        )
        assert mask[second] == 0  # the decision to hop carries no loss ...
        hop = chat.decode(tokens[second : turn_end(mask, 2)])
        assert all(mask[second + 1 : turn_end(mask, 2)]) and re.search(
            r'"query": "(KX-48\d\d|P-\d+)"', hop
        )  # ... its copy does
        assert chat.decode([t for t, m in zip(tokens, mask) if m]).count("<answer></answer>") == 1


@pytest.mark.slow  # two synthetic builds and their demonstrations, about 25 s
def test_the_default_demonstrates_second_searches_on_shown_identifiers(tmp_path):
    """The default's teacher hops on half of its demonstrations, and each demonstrated question (and
    rewrite) gets 2 more whose hop is forced (where an identifier is shown and the hop fits), each on an
    identifier copied from the first results; with teacher_hop=0 and hop_drills=0 every demonstration
    is one search and an answer."""
    from configs import default
    from mtrl_jax.setup import build
    from mtrl_jax.coldstart.demonstrations import demonstrations
    from mtrl_jax.coldstart.masks import assistant_turns

    shares = {}
    for name, overrides in (("default", {}), ("single", {"teacher_hop": 0.0, "hop_drills": 0})):
        config = default.get_config()
        with config.unlocked():
            config.warmup.update(overrides)
        components = build(config, tmp_path / name)
        components = dataclasses.replace(components, train_tasks=components.train_tasks[:60])
        demos = demonstrations(components)
        shares[name] = np.mean([assistant_turns(mask) == 3 for _, mask in demos])
        for tokens, mask in demos:
            if assistant_turns(mask) == 3:  # the hop's query is an identifier the first results showed
                text = components.chat.decode(tokens)
                first, second = list(re.finditer(r'"query": "([^"]*)"', text))[:2]
                assert second.group(1) in text[first.end() : second.start()], second.group(1)
    assert shares["single"] == 0.0
    assert 0.45 < shares["default"] < 0.85, shares  # at most (0.5 + 2) / 3: some show no identifier


def test_rejection_sampling_keeps_the_best_draw_or_those_over_the_threshold(tmp_path, monkeypatch):
    """``warmup.samples_per_task`` draws per training task; ``keep_best`` keeps, among the usable ones, the
    highest reward, of equals the shortest answer, then the first drawn; ``min_reward`` every usable one at
    least that good (judged on the training task's own relevance judgments)."""
    from configs import default
    from mtrl_jax.coldstart import demonstrations as warmup
    from mtrl_jax.setup import build

    drawn = []
    real_run = warmup.demonstration_run

    def recording(driver, task, policy):
        drawn.append(real_run(driver, task, policy))
        return drawn[-1]

    monkeypatch.setattr(warmup, "demonstration_run", recording)
    config = default.get_config()
    with config.unlocked():
        config.warmup.update(
            augment=0, hop_drills=0, samples_per_task=4, teacher_top_k="1:1,5:1", teacher_answers="empty:1,ids:1"
        )
    components = build(config, tmp_path)
    components = dataclasses.replace(components, train_tasks=components.train_tasks[:40])
    budget = components.collector.max_tokens_per_turn

    def usable(run):
        return run.episode.status == "ok" and warmup.longest_turn(run.trajectory.loss_mask) <= budget

    def select(**settings):
        drawn.clear()
        demos = warmup.demonstrations(
            dataclasses.replace(components, warmup=dataclasses.replace(components.warmup, **settings))
        )
        assert len(drawn) == 4 * len(components.train_tasks)
        return [tokens for tokens, _ in demos], [drawn[i : i + 4] for i in range(0, len(drawn), 4)]

    def best_tokens(runs):  # written out: the highest reward, of equals the shortest answer, then the first drawn
        best = max(run.episode.reward for run in runs)
        shortest = min(warmup.last_turn(run.trajectory.loss_mask) for run in runs if run.episode.reward == best)
        return next(
            run.trajectory.tokens
            for run in runs
            if run.episode.reward == best and warmup.last_turn(run.trajectory.loss_mask) == shortest
        )

    kept, groups = select(keep_best=True)
    expected = [best_tokens(usable_runs) for runs in groups if (usable_runs := [r for r in runs if usable(r)])]
    rewards = [[run.episode.reward for run in runs] for runs in groups]
    assert kept == expected and len(kept) == len(groups)
    assert sum(len(set(r)) > 1 for r in rewards) >= 5, rewards  # the draws differ: the choice is not trivial
    tied = [runs for runs in groups if len({run.episode.reward for run in runs}) < len(runs)]
    assert any(len({warmup.last_turn(run.trajectory.loss_mask) for run in runs}) > 1 for runs in tied)
    assert warmup.last_turn([0, 1, 1, 0, 0, 1, 1, 1, 0]) == 3 and warmup.last_turn([0, 1]) == 1
    assert warmup.last_turn([0, 0]) == 0

    # keep_best_per_searches: the best of each number of searches, fewest first (teacher_hop: some draws search twice)
    kept, groups = select(keep_best=True, keep_best_per_searches=True)
    expected = []
    for runs in groups:
        runs = [run for run in runs if usable(run)]
        for n in sorted({warmup.searches(run) for run in runs}):
            expected.append(best_tokens([run for run in runs if warmup.searches(run) == n]))
    assert kept == expected
    assert sum(len({warmup.searches(run) for run in runs if usable(run)}) > 1 for runs in groups) >= 5  # not trivial

    kept, groups = select(min_reward=0.5)
    expected = [run.trajectory.tokens for runs in groups for run in runs if usable(run) and run.episode.reward >= 0.5]
    assert kept == expected and 0 < len(kept) < sum(map(len, groups))

    kept, groups = select()  # neither: every usable draw
    assert kept == [run.trajectory.tokens for runs in groups for run in runs if usable(run)]

    # with keep_best, an augmented variant (no judgments to choose by) is drawn once, its draw kept if usable
    drawn.clear()
    augmented = dataclasses.replace(components.warmup, keep_best=True, augment=1)
    demos = warmup.demonstrations(dataclasses.replace(components, warmup=augmented))
    judged = [run for run in drawn if "#aug" not in run.episode.task.task_id]
    rewritten = [run for run in drawn if "#aug" in run.episode.task.task_id]
    assert len(judged) == 4 * len(components.train_tasks)
    assert [run.episode.task.task_id for run in rewritten] == [f"{t.task_id}#aug0" for t in components.train_tasks]
    judged_kept = sum(any(map(usable, judged[i : i + 4])) for i in range(0, len(judged), 4))  # the best of each
    assert len(demos) == judged_kept + sum(map(usable, rewritten)) > 1.5 * len(components.train_tasks)


def test_warmup_schedule_fields_are_checked():
    from configs import default
    from mtrl_jax.coldstart.settings import coldstart_settings as warmup_settings

    config = default.get_config()
    settings = warmup_settings(config)
    assert (settings.full_every, settings.two_turn_every) == (config.warmup.full_every, config.warmup.two_turn_every)
    from mtrl_jax.setup import check_config  # the ranges are checked once, in mtrl_jax/ranges.py

    config.warmup.full_every = 0
    with pytest.raises(ValueError, match="warmup.full_every=0 is out of range: expected 1 <= warmup.full_every"):
        check_config(config)
    config.warmup.full_every, config.warmup.two_turn_every = 8, -1
    with pytest.raises(ValueError, match=r"warmup.two_turn_every=-1 is out of range: .* \(0: never\)"):
        check_config(config)
    config.warmup.two_turn_every, config.warmup.keep_best_per_searches = 2, True
    with pytest.raises(ValueError, match="warmup.keep_best_per_searches=True chooses among warmup.keep_best's draws"):
        check_config(config)
    config.warmup.keep_best = True
    assert warmup_settings(config).keep_best_per_searches


@pytest.mark.slow
def test_the_warmup_step_on_loss_columns_and_micro_batches_equals_the_plain_step():
    """The output projection at the trained columns only, and the rows in micro-batches: the same loss and
    the same parameters after a step, to float rounding, with and without a shared prefix and adapters."""
    import jax
    import optax

    from mtrl_jax.model import ModelConfig, init_params, lora
    from mtrl_jax.coldstart.sft import loss_columns, warmup_step

    cfg = ModelConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        lora_rank=4,
    )
    frozen, trainable = lora.split(init_params(cfg, jax.random.PRNGKey(0)))
    trainable = jax.tree.map(lambda x: x + 0.05, trainable)  # B != 0: the adapters act
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 40, size=(4, 12)).astype(np.int32)
    attention = (np.arange(12)[None] < np.array([[12], [9], [7], [12]])).astype(np.int32)
    mask = ((rng.random((4, 12)) < 0.4) & (attention > 0)).astype(np.float32)
    mask[:, 0] = 0.0
    tx = optax.adam(1e-2)
    for shared in (np.zeros(0, np.int32), np.array([3, 5, 7], np.int32)):
        results = []
        for columns_only, micro in ((False, 1), (True, 1), (True, 2)):
            step = warmup_step(cfg, tx, shared, 8, columns_only, micro)
            batch = loss_columns(mask) if columns_only else mask
            params, _, loss, _ = step(trainable, tx.init(trainable), frozen, tokens, attention, batch)
            results.append((float(loss), params))
        for loss, params in results[1:]:
            assert abs(loss - results[0][0]) < 1e-5 * max(1.0, abs(loss))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(results[0][1])):
                np.testing.assert_allclose(a, b, atol=2e-5)
    columns, weights = loss_columns(np.array([[0, 1, 0, 1, 1], [0, 0, 1, 0, 0]], np.float32), multiple=4)
    assert columns.tolist() == [[1, 3, 4, 0], [2, 0, 0, 0]] and weights.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_an_answer_of_ids_is_cut_to_the_per_turn_token_limit():
    from mtrl_jax.chat import parse_answer
    from mtrl_jax.coldstart.masks import longest_turn

    policy = teacher_turns(np.random.default_rng(0), Teacher(("bm25_search",), answers=("ids",)))
    shown = "bm25_search results for 'q':\n" + "\n".join(
        f"[{i}] <dbpedia:Open_{chr(65 + i)}_tuning> | text" for i in range(1, 11)
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}]
    messages.append({"role": "tool", "content": shown})
    assert len(parse_answer(policy(messages))) == 10  # no limit: every id shown
    policy.fits = lambda text: len(text) <= 120
    answer = policy(messages)
    ids = parse_answer(answer)
    assert (
        len(answer) <= 120
        and 1 <= len(ids) < 10
        and ids == [f"<dbpedia:Open_{chr(65 + i)}_tuning>" for i in range(1, len(ids) + 1)]
    )
    assert longest_turn([0, 1, 1, 0, 1, 1, 1, 0]) == 3 and longest_turn([0, 0]) == 0


@pytest.mark.slow
def test_no_held_out_query_reaches_a_demonstration_or_the_rl_schedule(tmp_path, shared_data):
    from configs import default
    from mtrl_jax.setup import build
    from mtrl_jax.coldstart.demonstrations import demonstrations

    config = default.get_config()
    config.data.synthetic = False
    config.data.folders = f"{shared_data / 'cranfield'},{shared_data / 'scifact'}"
    config.data.weights = "1,1"
    config.data.dev_min = 25
    config.warmup.augment = 0
    config.rollout.max_len = 4096
    config.rollout.max_tokens_per_turn = 1024  # the default's small tokenizer spells real text nearly by letter
    c = build(config, tmp_path)
    held_out = {t.task_id for t in c.dev_tasks}
    assert len(held_out) >= 50 and not held_out & {t.task_id for t in c.train_tasks}
    assert not held_out & {t.task_id for t in c.schedule.tasks}  # what the RL steps draw from
    texts = [c.chat.decode(tokens) for tokens, _ in demonstrations(c)]
    train_queries = {t.query for t in c.train_tasks}
    assert sum(any(q in text for text in texts[:200]) for q in list(train_queries)[:100]) > 10  # the search sees them
    for task in c.dev_tasks:
        if task.query not in train_queries:  # a held-out question also asked in training is not a leak
            assert not any(task.query in text for text in texts), task.task_id


def test_failed_tool_calls_are_counted_and_said_in_every_phase():
    """Issue 71, item 17: a tool service failing while the demonstrations were built, or during an evaluation,
    was said nowhere (240 s of silence, then a worse cold start)."""
    import socket

    from mtrl_jax.metrics import headline, rollout_metrics, summarize
    from mtrl_jax.rollout.trajectory import Trajectory
    from mtrl_jax.search.tools import RemoteSearchTool, ServiceHealth
    from mtrl_jax.coldstart.demonstrations import demonstrations

    with socket.socket() as s:  # a port nothing listens on: every call is refused at once
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    docs = [Document(f"d{i}", f"Part {i}", f"pump number {i}") for i in range(5)]
    tasks = [Task(f"c/{i}", f"pump {i}", {f"d{i}": 1}, "c") for i in range(3)]
    health = ServiceHealth(dead, max_failures=10_000)
    failing = RemoteSearchTool("bm25_search", "d", f"{dead}/c", retries=0, health=health)
    env = make_environment(
        Collection("c", docs, tasks), SearchSettings(tools=()), SearchEnvConfig(tool_prompt="compact"), [failing]
    )
    chat = ChatFormat(train_tokenizer([d.text for d in docs] * 5 + ['<tool_call>\n{"name": "bm25_search"}'] * 5, 300))
    said = []
    demonstrations(_bm25_teacher(env, chat, tasks), log=said.append)
    assert said and "failed tool calls {'service_error': 3}" in said[-1], said
    # an evaluation's headline and an RL step's metrics say it too
    t = Trajectory("c/0", 0, 0, "c")
    t.reward, t.status, t.turns, t.counters = 0.0, "ok", [{}], {"tool_errors/service_error": 2, "tool_calls/bm": 2}
    assert "failed tool calls {'service_error': 2}" in headline("after RL", summarize([t]))
    assert rollout_metrics([t])["episodes/tool_errors/service_error"] == 2.0


def _call(text: str) -> dict:
    return json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))


def test_special_copies_write_quotes_backslashes_and_accents_and_the_calls_copy_them_exactly():
    from mtrl_jax.chat import parse_tool_calls
    from mtrl_jax.coldstart.teacher import special_question, special_tasks

    rng = np.random.default_rng(0)
    question = "which pump runs the cooling loop"
    edited = [special_question(question, rng) for _ in range(300)]
    assert any('"' in e for e in edited) and any("\\" in e for e in edited)
    assert any(ch in e for e in edited for ch in "áéíöüñç")
    for e in edited:
        changed = [(a, b) for a, b in zip(question.split(" "), e.split(" ")) if a != b]
        assert len(changed) == 1  # one word edited, the others as they were
        call = teacher_turns(rng, Teacher(("bm25_search",)))([{"role": "user", "content": e}])
        ((name, arguments, error_kind, _),) = parse_tool_calls(call)
        assert error_kind is None and arguments["query"] == e  # escaped in the JSON, read back exactly
    (copy,) = special_tasks(Task("t1", question, {"d1": 1}, "c"), 1, np.random.default_rng(1))
    assert copy.task_id == "t1#special0" and copy.qrels == {} and copy.query != question


def test_the_teacher_demonstrates_lists_of_queries_when_asked():
    question = "which pumps does the Acme plant use"
    shown = "bm25_search results for 'q':\n[1] d1 | Plant A-1 | part KX-4821.\n[2] d2 | Plant B-2 | part QQ-1111."
    lists = 0
    for i in range(200):
        policy = teacher_turns(np.random.default_rng(i), Teacher(TOOLS, hop=1.0, multi_query=0.5, max_queries=2))
        first = _call(policy([{"role": "user", "content": question}]))["arguments"]["query"]
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "x"},
            {"role": "tool", "content": shown},
        ]
        second = _call(policy(messages))["arguments"]["query"]
        if policy.queries > 1:
            lists += 1
            assert first == [question, "pumps Acme plant use"] and len(second) == 2 and len(set(second)) == 2
        else:
            assert first == question and isinstance(second, str)
    assert 70 < lists < 130
    # off (the default): the teacher draws as before, and a list is never written
    plain = teacher_turns(np.random.default_rng(3), Teacher(TOOLS, hop=1.0))
    first = _call(plain([{"role": "user", "content": question}]))["arguments"]["query"]
    assert plain.queries == 1 and first == question
