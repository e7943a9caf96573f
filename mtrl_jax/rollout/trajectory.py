"""``Trajectory``: one finished episode, token-level, and its JSON-line record."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

NOT_SAMPLED = -1  # version tag of tokens the policy did not sample (prompt, tool responses)


@dataclasses.dataclass
class Trajectory:
    task_id: str
    group_id: int
    sample_index: int  # position within the group
    task_type: str = ""  # the task's type (``Task.type``): the key of the per-type metrics
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 = sampled by the policy
    behav_logp: list[float] = dataclasses.field(default_factory=list)  # 0 where loss_mask is 0
    version: list[int] = dataclasses.field(default_factory=list)  # parameter version per token
    prompt_len: int = 0
    turns: list[dict] = dataclasses.field(default_factory=list)
    final_ranking: list[str] = dataclasses.field(default_factory=list)
    reward: Optional[float] = None
    status: Optional[str] = None
    counters: dict = dataclasses.field(default_factory=dict)
    advantage: Optional[float] = None  # its advantage, once an update has used it (None: not trained on)
    query: str = ""  # the task's question
    grades: dict = dataclasses.field(default_factory=dict)  # relevance grade of every document it was shown or answered

    def append(self, tokens, sampled: bool, logp=None, version: int = NOT_SAMPLED) -> None:
        tokens = [int(t) for t in tokens]
        self.tokens += tokens
        self.loss_mask += [int(sampled)] * len(tokens)
        self.behav_logp += [float(x) for x in logp] if sampled else [0.0] * len(tokens)
        self.version += [int(version)] * len(tokens) if sampled else [NOT_SAMPLED] * len(tokens)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def min_version(self) -> Optional[int]:
        sampled = [v for v in self.version if v != NOT_SAMPLED]
        return min(sampled) if sampled else None

    def to_record(self, step: Optional[int] = None, include_tokens: bool = False) -> dict:
        record = {
            "step": step,
            "task_id": self.task_id,
            "type": self.task_type,
            "query": self.query,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "reward": self.reward,
            "advantage": self.advantage,
            "status": self.status,
            "final_ranking": self.final_ranking,
            "num_turns": len(self.turns),
            "num_tokens": len(self.tokens),
            "num_sampled_tokens": self.num_sampled,
            "param_versions": sorted({v for v in self.version if v != NOT_SAMPLED}),
            "counters": self.counters,
            "turns": self.turns,
            "grades": self.grades,
        }
        if include_tokens:
            record.update(
                tokens=self.tokens, loss_mask=self.loss_mask, behav_logp=self.behav_logp, version=self.version
            )
        return record

    def to_json(self, step: Optional[int] = None, include_tokens: bool = False) -> str:
        return json.dumps(self.to_record(step, include_tokens))
