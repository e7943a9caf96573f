"""A checkpoint's own chat template (``model.chat_template='checkpoint'``): its jinja template compiled as
transformers compiles it, rendering the same protocol as the hand-written ChatML (``chat.ChatFormat``)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Sequence

from mtrl_jax.chat import IM_END, ChatFormat, load_tokenizer


def compile_chat_template(template: str):
    """A jinja chat template compiled as transformers' ``apply_chat_template`` compiles it (sandboxed,
    ``trim_blocks`` / ``lstrip_blocks``, loop controls, its ``tojson`` / ``raise_exception`` /
    ``strftime_now``), so that it renders the very same text."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (Qwen2.5's does; SmolLM2's does not, so
    the tools must then be described in the system message)."""
    import jinja2
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    )


_TURN, _MARK = "\ue000turn\ue000", "\ue000{}\ue001"  # private-use sentinels, never in real text


@dataclasses.dataclass
class TemplateChat(ChatFormat):
    """Renders with the checkpoint's own jinja chat template (``tokenizer_config.json``), token for
    token what transformers' ``apply_chat_template(messages, tools=...)`` gives.

    The tools go to the template only when the system message carries them (``"tools"``: the
    schemas, which the environment sets for ``env.tool_prompt="template"``); otherwise they are
    described in the system message's text. Environment replies are rendered as the template
    renders them after an assistant turn (the text following the turn's ``<|im_end|>``), with
    control-token text inside tool output encoded as plain text (see ``_encode_parts``)."""

    template: str = ""
    variables: dict = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ...: what the template may read

    def __post_init__(self):
        super().__post_init__()
        if not self.template:
            raise ValueError("TemplateChat needs a chat template")
        self._compiled = compile_chat_template(self.template)
        self.renders_tools = template_renders_tools(self.template)

    @classmethod
    def from_checkpoint(cls, directory: os.PathLike) -> "TemplateChat":
        directory = pathlib.Path(directory)
        config_file = directory / "tokenizer_config.json"
        if not config_file.exists():
            raise FileNotFoundError(
                f"{config_file}: not found (model.chat_template='checkpoint' renders with its chat_template)"
            )
        config = json.loads(config_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise ValueError(f"{config_file}: no chat_template")
        variables = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        return cls(load_tokenizer(directory / "tokenizer.json"), template=template, variables=variables)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        tools = None
        plain = []
        for m in messages:
            if "tools" in m:
                if not self.renders_tools:
                    raise ValueError(
                        "this chat template does not render tools: describe them in the system message "
                        "(env.tool_prompt='schemas')"
                    )
                tools = m["tools"]
            plain.append({k: v for k, v in m.items() if k != "tools"})
        return self._compiled.render(
            messages=plain, tools=tools, add_generation_prompt=add_generation_prompt, **self.variables
        )

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation(self, messages: Sequence[dict]) -> list[int]:
        marks = [_MARK.format(i) for i in range(len(messages))]
        head = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _TURN},
        ]
        text = self.render(
            head + [dict(m, content=mark) for m, mark in zip(messages, marks)], add_generation_prompt=True
        )
        at = text.find(_TURN)
        rest = text[at + len(_TURN) :] if at >= 0 else ""
        if not rest.startswith(IM_END):
            raise ValueError(
                f"the chat template does not close an assistant turn with {IM_END} right after its content; "
                "its replies cannot be appended to sampled turns"
            )
        rest, parts = rest[len(IM_END) :], []
        for m, mark in zip(messages, marks):
            before, found, rest = rest.partition(mark)
            if not found:
                raise ValueError(f"the chat template did not render a {m['role']!r} message's content")
            parts += [(before, False), (m["content"], m["role"] == "tool")]
        return self._encode_parts(parts + [(rest, False)])
