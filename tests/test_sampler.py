"""KV-cache sampler: greedy parity, behaviour log-probs, extend, stopping, determinism, buckets."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.model import compute_logits, load_hf_checkpoint
from mtrl_jax.rl.logprobs import sequence_logprobs
from mtrl_jax.rollout import engine as E
from mtrl_jax.rollout import sampler as S

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PROMPTS = [[5, 17, 33, 2], [9, 81, 4, 100, 7, 64, 12], [250]]


@pytest.fixture(scope="module")
def model_params():
    return load_hf_checkpoint(FIXTURES / "qwen3_untied")


def _run(model_params, temperature, top_p=(1.0, 1.0, 1.0), seed=0, stop=((-1,),) * 3, max_new=12, max_len=64):
    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=max_len, max_new_tokens=max_new)
    state, _ = smp.extend(params, smp.init(), PROMPTS)
    return smp.decode(params, state, jax.random.PRNGKey(seed), temperature, top_p, stop, [True] * 3)


def _padded(seqs):
    T = max(map(len, seqs))
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros_like(tokens)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, 1
    return jnp.asarray(tokens), jnp.asarray(mask)


def test_greedy_decode_equals_stepwise_argmax(model_params):
    model, params = model_params
    _, out = _run(model_params, temperature=[0.0] * 3)
    full_forward = jax.jit(lambda tokens, mask: compute_logits(model, params, tokens, mask))
    for row, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(12):
            tokens, mask = np.zeros((1, 32), np.int32), np.zeros((1, 32), np.int32)
            tokens[0, : len(seq)], mask[0, : len(seq)] = seq, 1
            logits = full_forward(tokens, mask)
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        assert list(np.asarray(out.tokens[row])) == seq[len(prompt) :]


def test_behaviour_logprobs_equal_teacher_forced_recompute(model_params):
    model, params = model_params
    temperature = np.array([1.0, 0.7, 1.3], np.float32)
    _, out = _run(model_params, temperature=temperature, top_p=[1.0, 0.9, 0.8], seed=3)
    seqs = [p + list(np.asarray(out.tokens[i, : out.num_tokens[i]])) for i, p in enumerate(PROMPTS)]
    tokens, mask = _padded(seqs)
    logp, _ = sequence_logprobs(model.config, params, tokens, mask, temperature=temperature, chunk_size=7)
    for i, p in enumerate(PROMPTS):
        n = int(out.num_tokens[i])
        np.testing.assert_allclose(np.asarray(logp[i, len(p) : len(p) + n]), np.asarray(out.logp[i, :n]), atol=1e-4)


def test_prefill_then_extend_equals_prefill_of_concatenation(model_params):
    model, params = model_params
    cfg = model.config
    extra = [[3, 4, 5], [], [6, 7, 8, 9, 10, 11]]
    smp = E.Sampler(cfg, slots=3, max_len=64, max_new_tokens=4)
    two_step, _ = smp.extend(params, smp.extend(params, smp.init(), PROMPTS)[0], extra)
    one_step, _ = smp.extend(params, smp.init(), [p + e for p, e in zip(PROMPTS, extra)])
    np.testing.assert_array_equal(two_step.lengths, one_step.lengths)
    np.testing.assert_allclose(
        S.next_token_logits(cfg, params, two_step), S.next_token_logits(cfg, params, one_step), atol=1e-4
    )
    # and both equal the plain forward's last-position logits
    tokens, mask = _padded([p + e for p, e in zip(PROMPTS, extra)])
    logits = compute_logits(model, params, tokens, mask)
    last = np.asarray([logits[i, len(p) + len(e) - 1] for i, (p, e) in enumerate(zip(PROMPTS, extra))])
    np.testing.assert_allclose(S.next_token_logits(cfg, params, one_step), last, atol=1e-4)


def test_stopped_row_writes_nothing_more(model_params):
    _, free = _run(model_params, temperature=[0.0] * 3)
    stop_id = int(free.tokens[1, 2])  # row 1 will stop on its third token
    stop = [[-1, -1], [stop_id, -1], [-1, -1]]
    state, out = _run(model_params, temperature=[0.0] * 3, stop=stop)
    first = list(np.asarray(free.tokens[1])).index(stop_id)
    assert int(out.num_tokens[1]) == first + 1
    assert S.STOP_REASONS[int(out.stop_reason[1])] == "stop_token"
    assert int(out.tokens[1, first]) == stop_id  # the stop token itself is kept
    assert np.all(np.asarray(out.tokens[1, first + 1 :]) == 0) and np.all(np.asarray(out.logp[1, first + 1 :]) == 0)
    length = len(PROMPTS[1]) + first + 1
    assert int(state.lengths[1]) == length
    assert np.all(np.asarray(state.cache.k[:, 1, :, length:]) == 0)  # nothing written past the stop
    assert S.STOP_REASONS[int(out.stop_reason[0])] == "max_new_tokens"


def test_inactive_rows_and_cache_full(model_params):
    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=16, max_new_tokens=12)
    state, _ = smp.extend(params, smp.init(), PROMPTS)
    before = np.asarray(state.cache.k[:, 0])
    state, out = smp.decode(params, state, jax.random.PRNGKey(0), [1.0] * 3, [1.0] * 3, [[-1]] * 3, [False, True, True])
    assert S.STOP_REASONS[int(out.stop_reason[0])] == "inactive" and int(out.num_tokens[0]) == 0
    np.testing.assert_array_equal(np.asarray(state.cache.k[:, 0]), before)
    assert S.STOP_REASONS[int(out.stop_reason[1])] == "cache_full"
    assert int(state.lengths[1]) == 16 and int(out.num_tokens[1]) == 16 - len(PROMPTS[1])


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_a_call_ending_at_a_window_edge_below_the_capacity_is_not_a_full_cache(model_params):
    """56 tokens + 8 new ones fill the 64-slot window exactly: the call ends at its token budget, not
    with a full cache (the cache holds 256), and the next call goes on in the next window."""
    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=256, max_new_tokens=8)
    state, _ = smp.extend(params, smp.init(), [list(range(1, 57)), [3, 4], [5]])
    for call in range(2):
        state, out = smp.decode(params, state, jax.random.PRNGKey(call), [1.0] * 3, [1.0] * 3, [[-1]] * 3, [True] * 3)
        assert [S.STOP_REASONS[int(r)] for r in out.stop_reason] == ["max_new_tokens"] * 3
    assert list(np.asarray(state.lengths)) == [72, 18, 17]
    smp = E.Sampler(model.config, slots=3, max_len=64, max_new_tokens=8)  # at the cache's own end it is full
    state, _ = smp.extend(params, smp.init(), [list(range(1, 57)), [3, 4], [5]])
    _, out = smp.decode(params, state, jax.random.PRNGKey(0), [1.0] * 3, [1.0] * 3, [[-1]] * 3, [True] * 3)
    assert S.STOP_REASONS[int(out.stop_reason[0])] == "cache_full" and int(out.num_tokens[0]) == 8


def test_samples_do_not_depend_on_slot_or_call_split(model_params):
    model, params = model_params
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    smp = E.Sampler(model.config, slots=3, max_len=64, max_new_tokens=12)
    state, _ = smp.extend(params, smp.init(), PROMPTS)
    _, whole = smp.decode(params, state, keys, [1.0] * 3, [1.0] * 3, [[-1]] * 3, [True] * 3)
    # rows in reverse slots, decoded in two calls of 5 and 7 tokens
    state, _ = smp.extend(params, smp.init(), PROMPTS[::-1])
    state, first = smp.decode(params, state, keys[::-1], [1.0] * 3, [1.0] * 3, [[-1]] * 3, [True] * 3, budget=[5] * 3)
    _, second = smp.decode(params, state, keys[::-1], [1.0] * 3, [1.0] * 3, [[-1]] * 3, [True] * 3, budget=[7] * 3)
    split = np.concatenate([np.asarray(first.tokens)[:, :5], np.asarray(second.tokens)[:, :7]], axis=1)[::-1]
    np.testing.assert_array_equal(split, np.asarray(whole.tokens))
    assert S.STOP_REASONS[int(first.stop_reason[0])] == "max_new_tokens" and int(first.num_tokens[0]) == 5


def test_same_key_same_samples_and_different_key_differs(model_params):
    _, a = _run(model_params, temperature=[1.0] * 3, seed=11)
    _, b = _run(model_params, temperature=[1.0] * 3, seed=11)
    _, c = _run(model_params, temperature=[1.0] * 3, seed=12)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logp, b.logp)
    assert not np.array_equal(a.tokens, c.tokens)


def test_top_p_restricts_to_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512))
    keys = jax.random.split(jax.random.PRNGKey(0), 512)
    tokens, logp = S.sample_tokens(logits, keys, jnp.ones(512), jnp.full(512, 0.7))
    assert set(np.asarray(tokens).tolist()) == {0, 1}
    np.testing.assert_allclose(logp, np.log(np.array([0.5, 0.3]))[np.asarray(tokens)], rtol=1e-5)  # full-vocab logp


def test_samples_follow_the_tempered_distribution():
    n = 40000
    probs = np.array([0.1, 0.0, 0.2, 0.3, 0.4])
    logits = jnp.log(jnp.asarray(np.tile(probs, (n, 1)), jnp.float32)) * 2.0  # temperature 2 gives back probs
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    tokens, _ = S.sample_tokens(logits, keys, jnp.full(n, 2.0), jnp.ones(n))
    counts = np.bincount(np.asarray(tokens), minlength=5) / n
    assert counts[1] == 0  # probability 0 is never drawn
    np.testing.assert_allclose(counts, probs, atol=0.01)  # ~5 standard errors
    greedy, _ = S.sample_tokens(logits[:4], keys[:4], jnp.array([0.0, 0.0, 2.0, 0.0]), jnp.ones(4))
    assert np.asarray(greedy)[[0, 1, 3]].tolist() == [4, 4, 4]  # greedy rows take the argmax, mixed with a sampled row


@pytest.mark.slow
def test_extend_computes_only_the_new_tokens_in_pieces(model_params):
    model, params = model_params
    cfg = model.config
    copy = lambda st: jax.tree.map(jnp.copy, st)  # noqa: E731 - extend donates its state
    smp = E.Sampler(cfg, slots=4, max_len=128, max_new_tokens=4, piece=8, max_lines=8)
    start, _ = smp.extend(params, smp.init(), PROMPTS + [[7, 8]])

    def check(blocks, computed, sampler=smp):
        pieces, counts = sampler.extend(params, copy(start), blocks)
        assert counts.computed == computed
        tokens = np.zeros((4, max(len(b) for b in blocks)), np.int32)
        for row, block in enumerate(blocks):
            tokens[row, : len(block)] = block
        everything = S.extend(cfg, params, copy(start), jnp.asarray(tokens), jnp.asarray([len(b) for b in blocks]), 128)
        np.testing.assert_array_equal(pieces.lengths, everything.lengths)
        np.testing.assert_allclose(pieces.last_hidden, everything.last_hidden, atol=1e-5)
        np.testing.assert_allclose(pieces.cache.k, everything.cache.k, atol=1e-5)
        idle = np.array([len(b) == 0 for b in blocks])
        np.testing.assert_array_equal(np.asarray(pieces.last_hidden)[idle], np.asarray(start.last_hidden)[idle])

    # row 1: 19 tokens = 3 pieces in one call (each sees the ones before it); row 3: 1 piece; 8 lines of 8
    check([[], list(range(1, 20)), [], [5, 6, 7]], 8 * 8)
    # 10 + 5 + 1 pieces: more than max_lines, so two calls, the first pieces of every row first
    check([list(range(1, 80)), [9] * 40, [], [4]], 2 * 8 * 8)
    # 17 pieces: 16 lines, then 8 (one of them useful), rather than 32 lines with 15 of padding
    wide = E.Sampler(cfg, slots=4, max_len=128, max_new_tokens=4, piece=8, max_lines=64)
    check([list(range(1, 70)), [9] * 40, [3] * 20, []], (16 + 8) * 8, wide)


def test_extend_calls_pad_at_most_a_quarter_of_their_lines_where_splitting_saves_lines():
    assert E.call_lines(40, 256, 0.75) == [32, 8]  # not 64
    assert E.call_lines(17, 256, 0.75) == [16, 8]  # not 32
    assert E.call_lines(9, 256, 0.75) == [16]  # 8 + 8 would compute as many lines, in two calls
    assert E.call_lines(600, 256, 0.75) == [256, 256, 64, 32]
    assert E.call_lines(40, 256, 0.0) == [64] and E.call_lines(600, 256, 0.0) == [256, 256, 128]  # fill 0: pad
    for n in range(1, 700):
        sizes = E.call_lines(n, 256, 0.75)
        assert all(s in (8, 16, 32, 64, 128, 256) for s in sizes)  # the same shapes as one padded call
        assert sum(sizes[:-1]) < n <= sum(sizes)  # every call but the last is full
        assert sum(sizes) <= sum(E.call_lines(n, 256, 0.0))  # never more lines than padding
        assert sum(sizes) - n <= max(7, 0.25 * sum(sizes))  # padding: at most a quarter, or what 8 lines leave


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_bucketed_shapes_reuse_compiled_programs(model_params):
    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=96, max_new_tokens=3, piece=16)  # shapes no other test compiles
    compiled = lambda fn: fn._cache_size()  # noqa: E731 - programs in the jit cache (one per new shape)
    extend0, decode0 = compiled(smp._extend), compiled(smp._decode)
    state = smp.init()
    for n in [3, 9, 16, 5, 12, 2]:  # at most 8 pieces of 16 per call, rows within the first 64-slot window
        state, _ = smp.extend(params, state, [[1] * n, [2] * (n // 2), []])
    assert compiled(smp._extend) - extend0 == 1
    state, _ = smp.extend(params, state, [[1] * 17, [], [3]])  # a longer block is more pieces: the same program
    assert compiled(smp._extend) - extend0 == 1
    state, _ = smp.extend(params, state, [[1] * 30, [], [3]])  # the longest row passes 64 slots: the 96-slot window
    assert compiled(smp._extend) - extend0 == 2
    state, _ = smp.extend(params, state, [[1] * 2, [], [3]])  # and stays there
    assert compiled(smp._extend) - extend0 == 2
    for seed, temp in enumerate([0.5, 1.0, 0.0]):  # new temperatures are arrays: no recompile
        state, _ = smp.decode(params, state, jax.random.PRNGKey(seed), [temp] * 3, [0.9] * 3, [[-1]] * 3, [True] * 3)
    assert compiled(smp._decode) - decode0 == 1
    assert [E.bucket_length(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


@pytest.mark.slow
def test_precompiled_programs_serve_every_call_shape(model_params):
    """``precompile`` compiles every (lines, window) extend shape and every decode window up front:
    calls of any mix of blocks then compile nothing, and give what the jitted functions give."""
    from mtrl_jax.metrics import CompileCounter

    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=96, max_new_tokens=4, piece=8, max_lines=16)
    extend_shapes, decode_windows = smp.call_shapes()
    assert extend_shapes == [(8, 64), (16, 64), (8, 96), (16, 96)] and decode_windows == [64, 96]
    stop = [[-1]] * 3

    def episode(rng):
        out, state = [], smp.init()
        for _ in range(6):  # blocks of 0-20 tokens per row, then 4 decoded tokens, until the cache is nearly full
            lengths = np.asarray(state.lengths)
            blocks = [list(rng.integers(1, 300, size=min(int(rng.integers(0, 21)), 96 - 4 - int(n)))) for n in lengths]
            state, _ = smp.extend(params, state, blocks)
            state, decoded = smp.decode(params, state, jax.random.PRNGKey(0), [0.0] * 3, [1.0] * 3, stop, [True] * 3)
            out.append((np.asarray(decoded.tokens), np.asarray(state.lengths), np.asarray(state.last_hidden)))
        return out

    smp.precompile(params)
    jitted = smp._extend._cache_size(), smp._decode._cache_size()
    episode(np.random.default_rng(0))  # the eager helpers (key splits, lengths) compile once
    mark = CompileCounter.mark()
    precompiled = episode(np.random.default_rng(1))
    assert CompileCounter.since(mark)["compile/programs"] == 0
    assert (smp._extend._cache_size(), smp._decode._cache_size()) == jitted  # no call fell back to jit
    for key in [k for k in smp._programs if k[1:3] == (3, 96)]:
        del smp._programs[key]  # the jitted functions, shape by shape
    for (a, la, ha), (b, lb, hb) in zip(precompiled, episode(np.random.default_rng(1))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_allclose(ha, hb, atol=1e-6)


@pytest.mark.slow  # kept out of the quick subset (its own share programs); the collector's sharing test stays in it
def test_new_sequences_share_cached_prefixes_and_give_what_computing_gives(model_params):
    """A row starting a new sequence takes the prefix of its block the cache already holds (in a row
    computed first in the same call, its own stale entries, another row's), only if computed with
    the same parameters: the states are what computing every token gives, with fewer tokens computed."""
    model, params = model_params
    other = jax.tree.map(lambda x: x * 1.01, params)
    system = list(range(40, 60))  # 20 tokens that every prompt but one starts with
    copy = lambda st: jax.tree.map(jnp.copy, st)  # noqa: E731 - extend donates its state

    def run(min_shared):
        smp = E.Sampler(model.config, slots=4, max_len=128, max_new_tokens=4, piece=8, min_shared=min_shared)
        states, computed, shared = [], [], []

        def extend(state, blocks, p=params):
            state, counts = smp.extend(p, state, blocks)
            computed.append(counts.extended)
            shared.append(counts.shared)
            states.append(copy(state))
            return state

        # rows 1 and 2 share row 0's first 22 and 20 tokens: row 0 is computed first, they copy them
        state = extend(smp.init(), [system + [1, 2, 3], system + [1, 2, 3], system + [7], [9, 8, 7, 6, 5]])
        state, out = smp.decode(params, state, jax.random.PRNGKey(0), [0.0] * 4, [1.0] * 4, [[-1]] * 4, [True] * 4)
        # rows 0 and 3 start over: row 0 takes its own stale system prompt, row 3 row 0's
        state = extend(
            smp.reset_rows(state, [True, False, False, True]), [system + [4, 4], [5], [], system + [6, 6, 6]]
        )
        # other parameters: nothing computed with the old ones is shared
        extend(smp.reset_rows(state, [True, False, False, False]), [system + [8], [], [], []], other)
        return states, computed, sum(shared), np.asarray(out.tokens)

    shared, computed, tokens_shared, decoded = run(4)
    plain, plain_computed, plain_shared, plain_decoded = run(0)
    # a row copies its shared prefix but for the last whole piece (8 tokens) of its block: the line it
    # computes holds real tokens, not its last token alone (rows 1, 2: 22 and 20 shared, 15 and 13 copied;
    # then rows 0 and 3: 20 shared, 14 and 15 copied)
    assert computed == [23 + 8 + 8 + 5, 8 + 1 + 8, 21] and tokens_shared == 15 + 13 + 14 + 15
    assert plain_computed == [23 + 23 + 21 + 5, 22 + 1 + 23, 21] and plain_shared == 0
    np.testing.assert_array_equal(decoded, plain_decoded)
    for a, b in zip(shared, plain):
        lengths = np.asarray(a.lengths)
        np.testing.assert_array_equal(lengths, b.lengths)
        held = np.arange(128)[None, :] < lengths[:, None]  # entries past a row's length are stale in both
        np.testing.assert_array_equal(np.where(held, a.tokens, 0), np.where(held, b.tokens, 0))
        np.testing.assert_allclose(a.last_hidden, b.last_hidden, atol=1e-5)
        for x, y in ((a.cache.k, b.cache.k), (a.cache.v, b.cache.v)):
            held_slots = held[None, :, None, :, None]  # cache [L, B, K, S, H]
            np.testing.assert_allclose(np.where(held_slots, x, 0), np.where(held_slots, y, 0), atol=1e-5)
    assert (np.asarray(shared[-1].tokens)[1:] == -1).all()  # forgotten: the other rows were computed with `params`


def test_decode_windows_start_above_the_shortest_prompt(model_params):
    """A decode call's rows hold a prompt of at least ``min_length`` tokens and attend to
    ``max_new_tokens`` more: the windows below that are not precompiled (no call takes them)."""
    model, _ = model_params
    full = E.Sampler(model.config, slots=3, max_len=512, max_new_tokens=48)
    assert full.call_shapes()[1] == [64, 96, 128, 192, 256, 384, 512]  # two an octave
    short = E.Sampler(model.config, slots=3, max_len=512, max_new_tokens=48, min_length=81)  # the default's
    assert short.call_shapes()[1] == [192, 256, 384, 512]
    assert (
        short.call_shapes()[0] == full.call_shapes()[0]
    )  # extend: every window (a call may hold a prompt's first pieces)
    assert E.Sampler(model.config, slots=3, max_len=512, max_new_tokens=48, min_length=600).call_shapes()[1] == [512]


def test_decode_window_follows_the_rows_budgets(model_params):
    """A decode call attends to the smallest decode window that holds its longest active row plus
    that row's budget (at most ``max_new_tokens``), never one below the precompiled windows."""
    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=512, max_new_tokens=48, min_length=81)
    state, _ = smp.extend(params, smp.init(), [[1] * 150, [2] * 90, [3] * 300])
    active = np.array([True, True, False])
    assert smp.window(state, active, np.array([48, 48, 48])) == 256  # 150 + 48
    assert smp.window(state, active, np.array([30, 48, 48])) == 192  # 150 + 30 (the row stops at its budget)
    assert smp.window(state, active, 500) == 256  # a budget above max_new_tokens reads max_new_tokens more
    assert smp.window(state, np.array([False, True, False]), 10) == 192  # 100 fits 128, not precompiled: 192
    assert smp.window(state, np.array([False, False, True]), 48) == 384
    assert E.window_for(97, 512, fine=True) == 128 and E.window_for(97, 512) == 128 and E.window_for(129, 512) == 256
    assert E.windows(4096, 300, fine=True) == [384, 512, 768, 1024, 1536, 2048, 3072, 4096]


def test_the_decode_window_changes_no_sample(model_params):
    """Attending to a wider window (more masked slots) gives the same sampled tokens and the same
    behaviour log-probs: the windows are a cost choice, not a numerical one."""
    model, params = model_params
    smp = E.Sampler(model.config, slots=3, max_len=256, max_new_tokens=16)
    base, _ = smp.extend(params, smp.init(), [list(range(1, 41)), [3, 4, 5], list(range(7, 30))])
    rows = (
        jax.random.split(jax.random.PRNGKey(5), 3),
        np.ones(3, np.float32),
        np.ones(3, np.float32),
        np.full((3, 1), -1, np.int32),
        np.ones(3, bool),
        np.full(3, 16, np.int32),
    )
    outs = [
        smp._decode(params, jax.tree.map(jnp.copy, base), S.DecodeRows(*rows), max_new_tokens=16, window=w)[1]
        for w in (64, 96, 256)
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out.tokens, outs[0].tokens)
        np.testing.assert_allclose(out.logp, outs[0].logp, rtol=1e-6, atol=1e-6)
