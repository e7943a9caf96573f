"""The hop probe: hop cases from the scripted teacher, and its measures checked with scripted policies."""

import json

import numpy as np
import pytest

from mtrl_jax.chat import ChatFormat, render_answer, tokenizer_seed_texts, train_tokenizer
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.probes import hop_cases, identifier_span, probe_hop_copy
from mtrl_jax.rollout.interfaces import EpisodeDriver
from mtrl_jax.search.build import SearchSettings, make_environment
from mtrl_jax.search.env import SearchEnvConfig
from mtrl_jax.warmup import teacher_turns

TOOLS = ("bm25_search", "vector_search")
MAX_LEN = 1024


@pytest.fixture(scope="module")
def setting():
    collection = make_synthetic_collection(0, num_parts=60, num_projects=30, queries_per_type=4)
    env = make_environment(collection, SearchSettings(tools=TOOLS, top_k=3, max_doc_chars=60, tfidf_dim=8),
                           SearchEnvConfig(tool_prompt="compact"))
    chat = ChatFormat(train_tokenizer([d.text for d in collection.documents] + [t.query for t in collection.tasks]
                                      + tokenizer_seed_texts(list(TOOLS)), 600))
    rng = np.random.default_rng(0)
    cases = hop_cases(EpisodeDriver(env, chat, MAX_LEN), collection.tasks,
                      lambda: teacher_turns(rng, list(TOOLS), None, (1, 3), None, hop=1.0), per_task=2)
    return chat, cases


def test_hop_cases_end_on_the_teachers_copy_of_a_shown_identifier(setting):
    chat, cases = setting
    assert len(cases) >= 12 and {c.task_type for c in cases} >= {"synthetic/multihop", "synthetic/describe"}
    for case in cases:
        turn = chat.decode(list(case.tokens[case.start:]))
        assert turn.startswith("<tool_call>") and turn.endswith(chat.decode([chat.im_end_id]))
        call = json.loads(turn.removeprefix("<tool_call>").split("</tool_call>")[0])
        assert call["arguments"]["query"] == case.identifier and case.identifier in case.shown
        assert chat.decode(list(case.tokens[:case.start])).count("assistant\n<tool_call>") == 1  # the first search, then this
        a, b = case.span
        assert case.start < a < b < len(case.tokens)
        # the span is the identifier after the token that begins it
        assert chat.decode(list(case.tokens[a - 1:b])).endswith(case.identifier) and len(chat.decode(list(case.tokens[a:b]))) < len(case.identifier)


def test_identifier_span_names_a_turn_without_the_query(setting):
    chat, _ = setting
    turn = chat.encode('<tool_call>\n{"name": "bm25_search", "arguments": {"query": "KX-4821"}}\n</tool_call>')
    a, b = identifier_span(chat, turn, "KX-4821")
    assert chat.decode(turn[a:b]) in ("X-4821", "-4821", "4821") and chat.decode(turn[:b]).endswith("KX-4821")
    with pytest.raises(ValueError, match="has no query 'QQ-1'"):
        identifier_span(chat, turn, "QQ-1")


class Scripted:
    """A policy that writes, after case i's context, the tokens ``continuation(i, k)`` (k: the k-th
    token after the hop call's start); its logits are one-hot."""

    def __init__(self, cases, vocab, continuation):
        self.cases, self.vocab, self.continuation = cases, vocab, continuation

    def logits(self, tokens, valid, positions):
        out = np.zeros(positions.shape + (self.vocab,), np.float32)
        for i, case in enumerate(self.cases):
            for j, p in enumerate(positions[i]):
                out[i, j, self.continuation(i, int(p) + 1 - case.start)] = 1.0
        return out

    def greedy(self, prompts, stop_id, max_new_tokens):
        out = []
        for i, prompt in enumerate(prompts):
            assert tuple(prompt) == self.cases[i].tokens[:self.cases[i].start]
            turn = []
            while len(turn) < max_new_tokens and (not turn or turn[-1] != stop_id):
                turn.append(self.continuation(i, len(turn)))
            out.append(turn)
        return out


def test_a_copying_policy_scores_one_and_an_answering_policy_zero(setting):
    chat, cases = setting
    teacher = Scripted(cases, chat.vocab_size, lambda i, k: cases[i].tokens[cases[i].start + k] if cases[i].start + k < len(cases[i].tokens)
                       else chat.im_end_id)
    result = probe_hop_copy(cases, teacher, chat, MAX_LEN, 48)
    by_position = result["all"].pop("id_token_accuracy_by_position")
    assert by_position == [1.0] * max(c.span[1] - c.span[0] for c in cases)
    assert result["all"] == {"cases": len(cases), "id_token_accuracy": 1.0, "id_exact": 1.0, "greedy_call": 1.0,
                             "greedy_shown": 1.0, "greedy_answer": 0.0}
    assert sum(result[t]["cases"] for t in result if t != "all") == len(cases)

    answer = chat.encode(render_answer([])) + [chat.im_end_id]
    answering = Scripted(cases, chat.vocab_size, lambda i, k: answer[min(max(k, 0), len(answer) - 1)])
    result = probe_hop_copy(cases, answering, chat, MAX_LEN, 48)["all"]
    assert result["greedy_answer"] == 1.0 and result["greedy_call"] == 0.0 and result["greedy_shown"] == 0.0
    assert result["id_exact"] == 0.0


def test_a_miscopying_policy_calls_but_not_on_a_shown_identifier(setting):
    chat, cases = setting
    wrong = []
    for case in cases:  # the teacher's call with the identifier's last digit changed: a call, not a copy
        text = chat.decode(list(case.tokens[case.start:]))
        digit = case.identifier[-1]
        bad = case.identifier[:-1] + str((int(digit) + 1) % 10) if digit.isdigit() else case.identifier + "0"
        wrong.append(chat.encode(text.replace(f'"{case.identifier}"', f'"{bad}"').replace(chat.decode([chat.im_end_id]), ""))
                     + [chat.im_end_id])
    miscopy = Scripted(cases, chat.vocab_size, lambda i, k: wrong[i][min(max(k, 0), len(wrong[i]) - 1)])
    result = probe_hop_copy(cases, miscopy, chat, MAX_LEN, 48)["all"]
    assert result["greedy_call"] == 1.0 and result["greedy_answer"] == 0.0
    assert result["greedy_shown"] < 0.2  # a changed identifier is rarely another one shown
    assert 0.5 < result["id_token_accuracy"] < 1.0 and result["id_exact"] < 0.2
    # the changed digit is each identifier's last token: the positions before it are all copied
    by_position = result["id_token_accuracy_by_position"]
    shortest = min(c.span[1] - c.span[0] for c in cases)
    assert by_position[:shortest - 1] == [1.0] * (shortest - 1) and by_position[-1] < 0.2


def test_the_probe_refuses_no_cases_and_cases_longer_than_the_context(setting):
    chat, _ = setting
    with pytest.raises(ValueError, match="no hop cases"):
        probe_hop_copy([], None, chat, MAX_LEN, 48)
    _, cases = setting
    with pytest.raises(ValueError, match=f"hop case of {cases[0].task_id}: {len(cases[0].tokens)} tokens, longer than max_len=10"):
        probe_hop_copy(cases, None, chat, 10, 48)


def test_model_policy_logits_are_the_forward_pass_logits_and_greedy_follows_them():
    import jax

    from mtrl_jax.model import ModelConfig, init_params
    from mtrl_jax.model.transformer import forward, logits_from_hidden
    from mtrl_jax.probes import ModelPolicy

    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = np.random.default_rng(0).integers(1, 40, size=(3, 12)).astype(np.int32)
    valid = np.arange(12)[None] < np.array([12, 7, 9])[:, None]
    positions = np.array([[0, 5], [6, 2], [8, 8]], np.int32)
    # the reference: one jitted forward pass (eager op-by-op calls cost seconds per shape)
    reference = jax.jit(lambda t, v: logits_from_hidden(cfg, params, forward(cfg, params, t, v)[0]))
    full = np.asarray(reference(tokens, valid))
    policy = ModelPolicy(cfg, params, 12)
    got = np.asarray(policy.logits(tokens, valid, positions))
    np.testing.assert_allclose(got, np.take_along_axis(full, positions[..., None], axis=1), rtol=1e-5, atol=1e-5)
    # greedy: each next token is the argmax of the forward pass's logits over the prompt and the tokens so far
    prompts = [list(tokens[0, :4]), list(tokens[1, :6])]
    contexts, produced = [], []
    for prompt, turn in zip(prompts, policy.greedy(prompts, stop_id=0, max_new_tokens=5)):
        assert 1 <= len(turn) <= 5 and (len(turn) == 5 or turn[-1] == 0)
        contexts += [prompt + turn[:k] for k in range(len(turn))]
        produced += turn
    grid = np.zeros((len(contexts), 12), np.int32)  # each context left-aligned, padded after its end (causal)
    for i, context in enumerate(contexts):
        grid[i, :len(context)] = context
    lengths = np.array([len(c) for c in contexts])
    last = np.asarray(reference(grid, np.arange(12)[None] < lengths[:, None]))[np.arange(len(contexts)), lengths - 1]
    assert produced == [int(t) for t in last.argmax(-1)]
