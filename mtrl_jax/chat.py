"""Tokenizer wrapper and the ChatML conversation format (Qwen style), rendered incrementally.

A trajectory is token-in/token-out: the prompt is rendered once, each assistant turn is exactly
the sampled tokens, and each environment reply is rendered as a *new block* of tokens appended
after them. Nothing already in the context is ever re-tokenised.

Layout (Qwen2.5 / Qwen3 chat templates)::

    <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n
    {sampled turn ... <|im_end|>}
    \n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...</tool_response><|im_end|>\n<|im_start|>assistant\n
    {sampled turn ... <|im_end|>}
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from tokenizers import Tokenizer

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Single tokens in Qwen3's vocabulary (added tokens), and so in the tokenizer trained here.
PROTOCOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


@dataclasses.dataclass
class ChatFormat:
    """Renders messages to token ids with an HF ``tokenizers`` tokenizer.

    ``assistant_prefix`` is text placed after ``<|im_start|>assistant\\n`` at every turn and
    counted as prompt (e.g. Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` to disable thinking).
    """

    tokenizer: Tokenizer
    assistant_prefix: str = ""

    def __post_init__(self):
        for special in (IM_START, IM_END):
            if self.tokenizer.token_to_id(special) is None:
                raise ValueError(f"tokenizer has no {special!r} token; the ChatML format needs it")
        self.im_end_id = self.tokenizer.token_to_id(IM_END)
        eot = self.tokenizer.token_to_id(END_OF_TEXT)
        self.stop_ids = [self.im_end_id] + ([eot] if eot is not None else [])
        self.pad_id = eot if eot is not None else 0

    @classmethod
    def from_file(cls, path: os.PathLike, assistant_prefix: str = "") -> "ChatFormat":
        return cls(Tokenizer.from_file(str(path)), assistant_prefix)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _assistant_header(self) -> str:
        return f"{IM_START}assistant\n{self.assistant_prefix}"

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """Tokens of the opening messages (system, user, ...) plus the assistant header."""
        text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        return self.encode(text + self._assistant_header())

    def continuation(self, messages: Sequence[dict]) -> list[int]:
        """Tokens appended after an assistant turn that ended with ``<|im_end|>``: the environment's
        messages (consecutive ``tool`` messages share one user block) and the next assistant header."""
        text = "\n"
        i = 0
        while i < len(messages):
            if messages[i]["role"] == "tool":
                text += f"{IM_START}user"
                while i < len(messages) and messages[i]["role"] == "tool":
                    text += f"\n<tool_response>\n{messages[i]['content']}\n</tool_response>"
                    i += 1
                text += f"{IM_END}\n"
            else:
                text += f"{IM_START}{messages[i]['role']}\n{messages[i]['content']}{IM_END}\n"
                i += 1
        return self.encode(text + self._assistant_header())

    def turn_text(self, ids: Sequence[int]) -> str:
        """The assistant text of a sampled turn, without the closing stop token."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.decode(ids)


def train_tokenizer(texts: Sequence[str], vocab_size: int = 2048) -> Tokenizer:
    """A small byte-level BPE tokenizer with the ChatML special tokens and, as in Qwen3's vocabulary,
    the tool-call tags as single tokens (the embedded default's).

    Digits are split one per token, as Qwen's tokenizers do: numbers the model has never seen
    (part identifiers, document ids) are then copied digit by digit instead of as rare merged
    tokens whose embeddings barely trained."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT, IM_START, IM_END, *PROTOCOL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
