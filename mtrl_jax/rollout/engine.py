"""The host side of the sampler: schedules the jitted kernels of ``mtrl_jax.rollout.sampler`` for a
fixed batch of generation rows.

* ``extend`` cuts every new block (a prompt, a tool response) into pieces of a few tokens and sends
  them as the lines of a call of one of a few shapes (``call_lines``), attending to a window just
  above the longest row (``windows``); a row starting a new sequence first copies the longest
  prefix of its block already in the cache (``share_prefixes``: the system prompt, the ``G``
  samples of one prompt).
* ``decode`` attends to the smallest of two windows an octave that holds its rows' budgets.
* ``precompile`` compiles every shape a call can take, ahead of time.

Each ``extend`` call returns its token counts as a value (``ExtendCounts``) beside the new state.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtrl_jax.compile_ahead import Programs
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import abstract_batch, activate, batch_sharding, cache_sharding, place_batch
from mtrl_jax.model.transformer import KVCache
from mtrl_jax.rollout.shapes import ExtendCounts, bucket_length, call_lines, window_for, windows  # noqa: F401
from mtrl_jax.rollout.sampler import DecodeRows, SamplerState, decode, extend, forget, init_state, share_prefixes


def state_sharding(mesh: Mesh, num_kv_heads: int = 0) -> SamplerState:
    """The shardings of a ``SamplerState``'s arrays on ``mesh``: rows over data x fsdp, KV heads over tensor
    (where ``num_kv_heads``, if given, divides by it)."""
    cache = cache_sharding(mesh, num_kv_heads)
    return SamplerState(
        KVCache(cache, cache),
        batch_sharding(mesh, 1),
        batch_sharding(mesh, 2),
        batch_sharding(mesh, 2),
    )


@functools.lru_cache(maxsize=None)
def _compiled(cfg: ModelConfig, mesh: Optional[Mesh]):
    """One set of jitted functions per model config and mesh, shared by every ``Sampler``. ``extend``
    and ``decode`` donate the sampler state (the KV cache is updated in place, never copied)."""
    shardings = None if mesh is None else state_sharding(mesh, cfg.num_kv_heads)
    return (
        jax.jit(functools.partial(extend, cfg), static_argnames=("window",), donate_argnums=(1,)),
        jax.jit(functools.partial(decode, cfg), static_argnames=("max_new_tokens", "window"), donate_argnums=(1,)),
        jax.jit(functools.partial(init_state, cfg), static_argnums=(0, 1), out_shardings=shardings),
        jax.jit(share_prefixes, static_argnames=("window",), donate_argnums=(0,), out_shardings=shardings),
        jax.jit(forget, donate_argnums=(0,), out_shardings=shardings),
        Programs("sampler"),  # programs compiled ahead of time (``Sampler.precompile``), by call signature
    )


def _common(a: np.ndarray, b: np.ndarray, n: int) -> int:
    """The length of the common prefix of ``a`` and ``b``, at most ``n``."""
    n = min(n, len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclasses.dataclass
class Sampler:
    """Host-side handle: fixed batch of ``slots`` rows, ``max_len`` cache slots per row. With a
    ``mesh`` the calls run with its logical-axis rules active and the cache split over rows
    (``data`` x ``fsdp``) and KV heads (``tensor``). A state passed to ``extend`` or ``decode`` is
    donated: use the returned one."""

    cfg: ModelConfig
    slots: int
    max_len: int
    max_new_tokens: int
    piece: int = 32  # extend: tokens per line of a call (blocks are cut into pieces of this many)
    max_lines: int = 256  # extend: lines per call at most (a power of two)
    fill: float = 0.75  # extend: useful lines per call at least, by splitting calls (``call_lines``)
    mesh: Optional[Mesh] = None
    # extend: a row starting a new sequence takes the cached keys and values of its longest prefix held
    # by any row (or computed in the same call) when that saves at least ``min_shared`` tokens; 0: never
    min_shared: int = 16
    # every row a decode call runs holds at least this many tokens (the shortest prompt): ``precompile``
    # leaves out the decode windows below it plus ``max_new_tokens``, which no call takes
    min_length: int = 0

    def __post_init__(self):
        self._extend, self._decode, self._init, self._share, self._forget, self._programs = _compiled(
            self.cfg, self.mesh
        )
        self._params = None  # weak references to the leaves of the parameters the cache entries were computed with

    @property
    def _max_lines(self) -> int:
        return max(8, bucket_length(self.max_lines, 1))

    def _extend_key(self, lines: int, window: int) -> tuple:
        return ("extend", self.slots, self.max_len, lines, self.piece, window)

    def _share_key(self, window: int) -> tuple:
        return ("share", self.slots, self.max_len, window)

    def _decode_key(self, window: int, rows) -> tuple:
        return (
            "decode",
            self.slots,
            self.max_len,
            self.max_new_tokens,
            window,
            tuple((tuple(x.shape), str(x.dtype)) for x in rows),
        )

    def _run(self, key, jitted, args, kwargs, static):
        """The program ``precompile`` compiled for ``key`` if there is one, else the jitted function (which
        compiles a new shape itself): ``compile_ahead.Programs.run``."""
        return self._programs.run(key, jitted, args, kwargs, static)

    def call_shapes(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Every ``(lines, window)`` an ``extend`` call can take, and every ``decode`` window. A
        call of ``lines`` > 8 lines holds more than ``lines / 2`` pieces (``call_lines``), and the rows
        within a window hold at most ``slots x ceil(window / piece)`` of them. A decode call's rows hold
        at least ``min_length`` tokens, and it attends to ``max_new_tokens`` more (``window`` takes no
        narrower one for a smaller budget)."""
        line_counts = [8 << i for i in range(self._max_lines.bit_length()) if 8 << i <= self._max_lines]
        extend_shapes = [
            (lines, w)
            for w in windows(self.max_len)
            for lines in line_counts
            if lines == 8 or lines // 2 < self.slots * -(-w // self.piece)
        ]
        return extend_shapes, self._decode_windows()

    def _decode_windows(self) -> list[int]:
        return windows(self.max_len, self.min_length + self.max_new_tokens, fine=True)

    def precompile(self, params, num_stop_tokens: int = 1, stop: Optional[threading.Event] = None) -> None:
        """Compile every ``extend`` and ``decode`` program of this sampler's shapes ahead of time
        (``call_shapes``; and ``forget`` and ``share_prefixes`` at every window), so that no call of a run waits on
        a compile of a shape first met late.
        Programs are shared by the samplers of one model config and mesh (the evaluation's, with the
        same slots, uses them too). Calls whose program is not ready yet compile it themselves (jit),
        as without it. ``num_stop_tokens``: the width of the ``stop_tokens`` the decode calls will
        pass. ``stop`` set: return after the program being compiled (the caller no longer needs the rest)."""
        state = jax.eval_shape(lambda: init_state(self.cfg, self.slots, self.max_len))
        if self.mesh is not None:
            state = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                state,
                state_sharding(self.mesh, self.cfg.num_kv_heads),
            )
        extend_shapes, decode_windows = self.call_shapes()
        # every argument abstract (nothing runs: this may be a background thread beside the main one's programs)
        rows = (
            jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), self.slots)),
            np.ones(self.slots, np.float32),
            np.ones(self.slots, np.float32),
            np.zeros((self.slots, num_stop_tokens), np.int32),
            np.ones(self.slots, bool),
            np.ones(self.slots, np.int32),
        )

        def lower_extend(lines, window):
            line = np.zeros(lines, np.int32)
            tokens, num_new = abstract_batch((np.zeros((lines, self.piece), np.int32), line), self.mesh)
            return self._extend.lower(
                params, state, tokens, num_new, window=window, rows=line, starts=line, last=np.zeros(lines, bool)
            )

        def lower_decode(window):
            return self._decode.lower(
                params,
                state,
                DecodeRows(*abstract_batch(rows, self.mesh)),
                max_new_tokens=self.max_new_tokens,
                window=window,
            )

        index = np.zeros(self.slots, np.int32)
        jobs = [(("forget", self.slots, self.max_len), lambda: self._forget.lower(state))]
        jobs += [(self._extend_key(lines, w), functools.partial(lower_extend, lines, w)) for lines, w in extend_shapes]
        jobs += [(self._decode_key(w, rows), functools.partial(lower_decode, w)) for w in decode_windows]
        if self.min_shared:
            jobs += [
                (self._share_key(w), functools.partial(self._share.lower, state, index, index, index, window=w))
                for w in windows(self.max_len)
            ]
        with activate(self.mesh):
            for key, lower in jobs:
                if stop is not None and stop.is_set():
                    return
                self._programs.compile(key, lower)

    def window(self, state: SamplerState, rows, new_tokens) -> int:
        """The cache slots a decode call attends to: the smallest of the decode windows (``windows``,
        two an octave, none below the one ``precompile`` starts at) that holds the longest of
        ``rows`` plus its ``new_tokens`` (one count, or one per row: the rows' budgets). A handful of
        values, so a handful of programs; the per-token cost follows the tokens held, not the
        cache's capacity."""
        rows = np.asarray(rows, bool)
        lengths = np.asarray(jax.device_get(state.lengths))[rows]
        new = np.broadcast_to(np.minimum(np.asarray(new_tokens), self.max_new_tokens), rows.shape)[rows]
        reach = int((lengths + new).max()) if lengths.size else 0
        return max(window_for(reach, self.max_len, fine=True), self._decode_windows()[0])

    def init(self) -> SamplerState:
        with activate(self.mesh):
            return self._init(self.slots, self.max_len)

    def extend(self, params, state: SamplerState, blocks: Sequence[Sequence[int]]) -> tuple[SamplerState, ExtendCounts]:
        """Append ``blocks[b]`` (possibly empty) to each row; returns the new state and what was appended.

        Only the new tokens are computed: every block is cut into pieces of ``piece`` tokens, and
        the pieces go to the device as the lines of a block (a power of two >= 8 of them, at
        most ``max_lines``; more pieces take more calls, earlier pieces first, and a call whose
        padding would exceed ``1 - fill`` of its lines is split: ``call_lines``). So a call's
        shape is one of a few (lines x ``piece``, and the attention window), whatever the mix of
        prompts and tool replies. ``ExtendCounts.extended`` / ``computed`` count the real tokens and
        the computed ones (padding included).

        A row that holds no tokens (a new sequence) first takes the longest prefix of its block
        that the cache already holds, computed with these parameters, in any row: its own stale
        entries, another row's, or, when that is longer, a row of this very call (whose block is
        computed first, and the prefix copied after it), if that saves at least ``min_shared``
        tokens. Its last token is always computed (the next-token state). ``ExtendCounts.shared`` counts
        the tokens copied instead of computed."""
        if len(blocks) != self.slots:
            raise ValueError(f"extend: got {len(blocks)} blocks for {self.slots} slots")
        state = self._current(params, state)
        if not any(len(b) for b in blocks):
            return state, ExtendCounts()
        lengths = np.asarray(jax.device_get(state.lengths)).copy()  # host copy, advanced call by call
        blocks, held, later = self._plan_sharing(state, blocks, lengths) if self.min_shared else (list(blocks), [], {})
        state, counts = self._copy(state, held, lengths)
        if later:  # the prefixes held nowhere yet: copied once this call's other rows are computed
            state, computed = self._extend_pieces(
                params, state, [[] if row in later else b for row, b in enumerate(blocks)], lengths
            )
            state, copied = self._copy(state, [(leader, row, count) for row, (leader, count) in later.items()], lengths)
            counts = counts + computed + copied
            blocks = [blocks[row][later[row][1] :] if row in later else [] for row in range(self.slots)]
        state, computed = self._extend_pieces(params, state, blocks, lengths)
        return state, counts + computed

    def _current(self, params, state: SamplerState) -> SamplerState:
        """``state`` with its record of shareable entries cleared if ``params`` are not the ones its
        entries were computed with: every leaf the same array (weak references: the sampler keeps no
        parameters alive; with LoRA only the adapters change, so the first leaf would not tell)."""
        leaves = jax.tree.leaves(params)
        if (
            self._params is not None
            and len(self._params) == len(leaves)
            and all(ref() is leaf for ref, leaf in zip(self._params, leaves))
        ):
            return state
        self._params = [weakref.ref(leaf) for leaf in leaves]
        with activate(self.mesh):
            return self._run(("forget", self.slots, self.max_len), self._forget, (state,), {}, {})

    def _plan_sharing(self, state: SamplerState, blocks, lengths: np.ndarray) -> tuple[list, list, dict]:
        """The prefixes new rows share: the blocks left to compute, ``(source, row, count)`` for the
        prefixes the cache holds now, and ``{row: (leader, count)}`` for those that a row of this call
        (a leader) computes first."""
        blocks = [np.asarray(b, np.int32) for b in blocks]
        new = [row for row, b in enumerate(blocks) if lengths[row] == 0 and len(b) > self.min_shared]
        if not new:
            return blocks, [], {}
        held = np.asarray(jax.device_get(state.tokens))
        pairs, later, leaders = [], {}, []
        for row in new:
            block, n = blocks[row], len(blocks[row]) - 1  # the last token is computed: its hidden state
            prefix = np.cumprod(held[:, :n] == block[None, :n], axis=1).sum(axis=1)
            source = row if prefix[row] == prefix.max() else int(prefix.argmax())  # its own entries first
            count = int(prefix[source])
            best = max(((_common(blocks[leader], block, n), leader) for leader in leaders), default=(0, -1))
            copied = self._whole_pieces(len(block), best[0])
            if best[0] >= count + self.min_shared and copied:  # nothing to copy: not worth waiting for the leader
                later[row] = (best[1], copied)
                continue
            leaders.append(row)
            if count >= self.min_shared:
                count = self._whole_pieces(len(block), count)
                if count:
                    pairs.append((source, row, count))
                    blocks[row] = block[count:]
        return blocks, pairs, later

    def _whole_pieces(self, length: int, count: int) -> int:
        """``count`` shared tokens of a ``length``-token block, cut so that the rest is whole pieces:
        the extend lines it takes are as many, and hold real tokens instead of padding (a copied
        prompt would otherwise leave its last token alone in a line)."""
        return max(0, length - -(-(length - count) // self.piece) * self.piece)

    def _copy(self, state: SamplerState, pairs, lengths: np.ndarray) -> tuple[SamplerState, ExtendCounts]:
        """``share_prefixes`` for ``(source, row, count)`` pairs (padded to ``slots``); advances ``lengths``."""
        if not pairs:
            return state, ExtendCounts()
        src, dst, count = (
            np.zeros(self.slots, np.int32),
            np.full(self.slots, self.slots, np.int32),
            np.zeros(self.slots, np.int32),
        )
        for i, (source, row, n) in enumerate(pairs):
            src[i], dst[i], count[i] = source, row, n
            lengths[row] = n
        window = window_for(int(count.max()), self.max_len)
        with activate(self.mesh):
            state = self._run(self._share_key(window), self._share, (state, src, dst, count), {}, dict(window=window))
        return state, ExtendCounts(shared=int(count.sum()))

    def _extend_pieces(
        self, params, state: SamplerState, blocks, lengths: np.ndarray
    ) -> tuple[SamplerState, ExtendCounts]:
        """The extend calls that append ``blocks`` to rows holding ``lengths`` tokens (advanced here)."""
        pieces = sorted((start, row) for row, block in enumerate(blocks) for start in range(0, len(block), self.piece))
        counts = ExtendCounts()
        if not pieces:
            return state, counts
        added = np.zeros(self.slots, np.int64)  # tokens of each row's block already on the device
        first = 0
        for lines in call_lines(len(pieces), self._max_lines, self.fill):
            call = pieces[first : first + lines]
            first += lines
            tokens = np.zeros((lines, self.piece), np.int32)
            rows, starts, num_new = np.zeros(lines, np.int32), np.zeros(lines, np.int32), np.zeros(lines, np.int32)
            last = np.zeros(lines, bool)
            for line, (start, row) in enumerate(call):
                chunk = blocks[row][start : start + self.piece]
                tokens[line, : len(chunk)] = chunk
                rows[line], starts[line], num_new[line] = row, start - added[row], len(chunk)
                last[line] = start + len(chunk) >= len(blocks[row])
            reach = lengths[rows] + starts + num_new
            window = window_for(int(reach.max()), self.max_len)
            counts = counts + ExtendCounts(extended=int(num_new.sum()), computed=tokens.size)
            np.add.at(lengths, rows, num_new)
            np.add.at(added, rows, num_new)
            with activate(self.mesh):
                state = self._run(
                    self._extend_key(lines, window),
                    self._extend,
                    (params, state, *place_batch((tokens, num_new), self.mesh)),
                    dict(rows=rows, starts=starts, last=last),
                    dict(window=window),
                )
        return state, counts

    def decode(self, params, state, row_keys, temperature, top_p, stop_tokens, active, budget=None):
        """``row_keys``: ``[B]`` PRNG keys, or one key (split into per-row keys)."""
        state = self._current(params, state)
        row_keys = jnp.asarray(row_keys)
        if row_keys.ndim == 1 and not jnp.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
            row_keys = jax.random.split(row_keys, self.slots)
        if budget is None:
            budget = np.full(self.slots, self.max_new_tokens, np.int32)
        rows = (
            row_keys,
            np.asarray(temperature, np.float32),
            np.asarray(top_p, np.float32),
            np.asarray(stop_tokens, np.int32),
            np.asarray(active, bool),
            np.asarray(budget, np.int32),
        )
        window = self.window(state, rows[4], rows[5])
        with activate(self.mesh):
            return self._run(
                self._decode_key(window, rows),
                self._decode,
                (params, state, DecodeRows(*place_batch(rows, self.mesh))),
                {},
                dict(max_new_tokens=self.max_new_tokens, window=window),
            )

    def lower_decode(self, params, state, row_keys, temperature, top_p, stop_tokens, active, budget):
        """``decode`` lowered for these (abstract, placed) arguments, for ``tools/plan_scale.py``."""
        with activate(self.mesh):
            rows = DecodeRows(row_keys, temperature, top_p, stop_tokens, active, budget)
            return self._decode.lower(params, state, rows, max_new_tokens=self.max_new_tokens)

    def reset_rows(self, state: SamplerState, rows) -> SamplerState:
        """Empty the given rows (a new episode starts there); stale cache entries are masked out."""
        rows = jnp.asarray(rows, bool)
        return state._replace(lengths=jnp.where(rows, 0, state.lengths))
