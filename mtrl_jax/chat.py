"""The one home of the conversation and tool-call protocol: the tokenizer wrapper, ChatML
rendering (Qwen style, incremental), the tags, the system prompts, the rendering and parsing of tool
calls and answers, and the strings a tiny tokenizer is seeded with.

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
import json
import os
import pathlib
import re
from typing import NamedTuple, Optional, Sequence

from tokenizers import Tokenizer

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# Single tokens in Qwen3's vocabulary (added tokens), and so in the tokenizer trained here.
PROTOCOL_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)

TOOL_CALL = re.compile(f"{TOOL_CALL_OPEN}(.*?){TOOL_CALL_CLOSE}", re.DOTALL)
ANSWER = re.compile(f"{ANSWER_OPEN}(.*?){ANSWER_CLOSE}", re.DOTALL)
TOOL_ERROR_PREFIX = "Error: "

DEFAULT_INSTRUCTIONS = (
    "You are a search agent. Use the search tools to find the documents that answer the user's question, "
    f'then reply with their ids, best first, as a JSON list of strings: {ANSWER_OPEN}["id1", "id2", ...]{ANSWER_CLOSE}.'
)
# The compact prompt's: every token of the system prompt is in every sequence the tiny model trains on.
COMPACT_INSTRUCTIONS = f"Search, then answer with document ids, best first: {ANSWER_OPEN}id1, id2{ANSWER_CLOSE}."

TOOLS_TEMPLATE = """

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{schemas}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

TOOL_PROMPTS = ("schemas", "compact", "template", "auto")


def system_prompt(
    tool_schemas: Sequence[dict], tool_prompt: str = "schemas", instructions: Optional[str] = None
) -> str:
    """The system message listing the tools (``{"type": "function", "function": {...}}`` schemas).

    ``"schemas"``: the JSON schemas in ``<tools></tools>``, as Qwen chat templates render them;
    ``"compact"``: short instructions and one line naming the tools (the tiny default, whose
    every training sequence carries this prompt); ``"template"``: the instructions only, the
    checkpoint's own chat template rendering the tools (``TemplateChat``, given the schemas)."""
    if tool_prompt == "compact":
        tools = ", ".join(
            f"{f['function']['name']}({', '.join(f['function']['parameters'].get('properties', {}))})"
            for f in tool_schemas
        )
        return (
            f"{COMPACT_INSTRUCTIONS if instructions is None else instructions}\nTools: {tools}; "
            f"call as {TOOL_CALL_OPEN}{{\"name\": ..., \"arguments\": {{...}}}}{TOOL_CALL_CLOSE}"
        )
    if tool_prompt == "template":  # the checkpoint's chat template renders the tools (TemplateChat)
        return DEFAULT_INSTRUCTIONS if instructions is None else instructions
    if tool_prompt != "schemas":
        raise ValueError(
            f"env.tool_prompt must be one of {TOOL_PROMPTS[:3]} (or 'auto', resolved by setup), got {tool_prompt!r}"
        )
    schemas = "\n".join(json.dumps(f) for f in tool_schemas)
    return (DEFAULT_INSTRUCTIONS if instructions is None else instructions) + TOOLS_TEMPLATE.format(schemas=schemas)


def render_tool_call(name: str, arguments: dict) -> str:
    """One call as the cold start's teacher writes it. Characters outside ASCII are written as they are, as
    the checkpoints' templates' ``tojson`` writes them (``ensure_ascii=False``): a question's "α" is copied
    into the call as "α", the tokens the model has just read, not spelt out as the escape "\\u03b1"."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def render_answer(doc_ids: Sequence[str]) -> str:
    """The final answer: a JSON list of ids, so that any id (commas, spaces, quotes included) is carried
    exactly; no ids gives the empty answer (the environment's fallback ranks the searches' results)."""
    return f"{ANSWER_OPEN}{json.dumps(list(doc_ids), ensure_ascii=False) if doc_ids else ''}{ANSWER_CLOSE}"


class ParsedCall(NamedTuple):
    """One ``<tool_call>`` block: ``name`` and ``arguments``, or ``error_kind`` and ``error``."""

    name: Optional[str]
    arguments: Optional[dict]
    error_kind: Optional[str] = None
    error: Optional[str] = None


# Qwen2.5-Coder writes its calls as fenced JSON (```json {"name": ..., "arguments": ...} ```)
FENCED = re.compile(r"```[A-Za-z_]*[ \t]*\n?(.*?)```", re.DOTALL)


def _looks_like_call(body: str) -> bool:
    body = body.strip()
    return body[:1] in ("{", "[") and '"name"' in body


def _parse_call_body(body: str) -> list[ParsedCall]:
    """One call body: a JSON object ``{"name": ..., "arguments": {...}}`` (Qwen, Hermes), or a JSON
    list of them (SmolLM2's format); ``arguments`` may also be a JSON string of an object (OpenAI's)."""
    try:
        parsed = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return [ParsedCall(None, None, "bad_json", f"invalid JSON in tool call: {e.msg}")]
    except (RecursionError, ValueError) as e:  # nesting too deep, an integer of thousands of digits
        return [ParsedCall(None, None, "bad_json", f"invalid JSON in tool call: {type(e).__name__}")]
    items = parsed if isinstance(parsed, list) and parsed else [parsed]
    calls = []
    for call in items:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ParsedCall(None, None, "bad_format", 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (RecursionError, ValueError):
                pass
        if not isinstance(arguments, dict):
            calls.append(
                ParsedCall(call["name"], None, "bad_arguments", f"{call['name']}: arguments must be a JSON object")
            )
            continue
        calls.append(ParsedCall(call["name"], arguments))
    return calls


def bare_calls(text: str) -> list[str]:
    """The JSON objects in ``text`` that look like calls (``{"name": ...}``), outside any fence, in order
    (Qwen2.5-Coder writes them bare, e.g. on MuSiQue): each ``{`` that starts a whole JSON object."""
    decoder, bodies, at = json.JSONDecoder(), [], text.find("{")
    while at >= 0:
        try:
            _, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            at = text.find("{", at + 1)
            continue
        if _looks_like_call(text[at:end]):
            bodies.append(text[at:end])
        at = text.find("{", end)
    return bodies


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every tool call of an assistant turn, in order: the ``<tool_call>`` blocks (Qwen / Hermes JSON
    bodies, or a JSON list of calls), or, in a turn with neither those nor an ``<answer>``, fenced
    code blocks holding call JSON, or else bare call JSON objects (the forms Qwen2.5-Coder emits)."""
    bodies = TOOL_CALL.findall(text)
    if not bodies and TOOL_CALL_OPEN not in text and ANSWER_OPEN not in text:
        bodies = [b for b in FENCED.findall(text) if _looks_like_call(b)] or bare_calls(text)
    calls = [call for body in bodies for call in _parse_call_body(body)]
    if text.count(TOOL_CALL_OPEN) > len(TOOL_CALL.findall(text)):
        calls.append(ParsedCall(None, None, "bad_format", f"unterminated {TOOL_CALL_OPEN} (missing {TOOL_CALL_CLOSE})"))
    return calls


def parse_answer(text: str) -> Optional[list[str]]:
    """Doc ids in the last ``<answer>`` block (``None`` when there is none): a JSON list of strings
    (the format the prompt asks for, which carries any id), or else ids separated by commas or white
    space (ids with those characters need the JSON form)."""
    blocks = ANSWER.findall(text)
    if not blocks:
        return None
    body = blocks[-1].strip()
    try:
        parsed = json.loads(body)
        if isinstance(parsed, list):
            return [x if isinstance(x, str) else json.dumps(x) for x in parsed]
    except (RecursionError, ValueError):  # not JSON (or nested too deep / numbers too long): ids as text
        pass
    return [t.strip("\"'[]") for t in re.split(r"[,\s]+", body) if t.strip("\"'[]")]


def tokenizer_seed_texts(tool_names: Sequence[str], copies: int = 50) -> list[str]:
    """Protocol strings a tiny tokenizer is trained on besides the corpus, so that calls, answers and
    tool errors get compact tokens."""
    texts = [render_tool_call(name, {"query": "x"}) for name in tool_names]
    texts += [render_answer([]), f"{TOOL_RESPONSE_OPEN}\n{TOOL_RESPONSE_CLOSE}", TOOL_ERROR_PREFIX]
    return texts * copies


def load_tokenizer(path: os.PathLike) -> Tokenizer:
    """A ``tokenizer.json``; a missing, truncated or malformed file is an error that names it (the tokenizers
    library's own message names no file)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a bad file
        raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from e


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
        added = sorted({t.content for t in self.tokenizer.get_added_tokens_decoder().values()}, key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, added))) if added else None

    @classmethod
    def from_file(cls, path: os.PathLike, assistant_prefix: str = "") -> "ChatFormat":
        return cls(load_tokenizer(path), assistant_prefix)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _assistant_header(self) -> str:
        return f"{IM_START}assistant\n{self.assistant_prefix}"

    def _encode_parts(self, parts: Sequence[tuple[str, bool]]) -> list[int]:
        """Encode ``(text, untrusted)`` parts as one string, except that control-token text (an added
        token's string, such as ``<|im_end|>`` or ``<tool_call>``) inside an *untrusted* part (a tool's
        output, which echoes documents and the model's own queries) is encoded as ordinary text, so it
        can never inject a control token. Parts we author (the system prompt, which names the
        ``<tool_call>`` tag, and the user's question) are encoded as the chat template would."""
        if self._control is None or not any(content and self._control.search(text) for text, content in parts):
            return self.encode("".join(text for text, _ in parts))
        ids, pending = [], ""
        for text, content in parts:
            if not content:
                pending += text
                continue
            last = 0
            for match in self._control.finditer(text):
                pending += text[last : match.start()]
                ids += self.encode(pending) + self.encode(match.group()[0]) + self.encode(match.group()[1:])
                pending, last = "", match.end()
            pending += text[last:]
        return ids + self.encode(pending)

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """Tokens of the opening messages (system, user, ...) plus the assistant header."""
        return self.encode(
            "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages) + self._assistant_header()
        )

    def continuation(self, messages: Sequence[dict]) -> list[int]:
        """Tokens appended after an assistant turn that ended with ``<|im_end|>``: the environment's
        messages (consecutive ``tool`` messages share one user block) and the next assistant header."""
        parts = [("\n", False)]
        i = 0
        while i < len(messages):
            if messages[i]["role"] == "tool":
                parts.append((f"{IM_START}user", False))
                while i < len(messages) and messages[i]["role"] == "tool":
                    parts += [
                        (f"\n{TOOL_RESPONSE_OPEN}\n", False),
                        (messages[i]["content"], True),
                        (f"\n{TOOL_RESPONSE_CLOSE}", False),
                    ]
                    i += 1
                parts.append((f"{IM_END}\n", False))
            else:
                parts.append((f"{IM_START}{messages[i]['role']}\n{messages[i]['content']}{IM_END}\n", False))
                i += 1
        return self._encode_parts(parts + [(self._assistant_header(), False)])

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
    tokens whose embeddings barely trained. Runs of capital letters (the letters of an identifier
    such as ``KX-4821``, acronyms) are split one letter per token for the same reason, and so that an
    identifier has the same tokens wherever it appears: after a space, a quote or a line break (a
    merged ``" KX"`` in a search result against ``"K"``, ``"X"`` in a tool call's query is a copy the
    tiny policy does not learn)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    capitals = pre_tokenizers.Split(Regex(r"\p{Lu}(?=\p{Lu})|(?<=\p{Lu})\p{Lu}"), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), capitals, pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END, *PROTOCOL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
