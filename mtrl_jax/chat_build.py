"""A run's chat format from its config (``setup.build`` calls ``build_chat``): the checkpoint's own chat template
(``model.chat_template="checkpoint"``), a tokenizer file, or the tiny model's tokenizer, trained on the corpus the
first time and reused on resume; and ``env.tool_prompt`` with "auto" resolved against that template."""

from __future__ import annotations

import pathlib
from typing import Mapping, Optional

from mtrl_jax import distributed
from mtrl_jax.chat import ChatFormat, tokenizer_seed_texts, train_tokenizer
from mtrl_jax.chat_template import TemplateChat
from mtrl_jax.data.build import csv
from mtrl_jax.data.collection import Collection
from mtrl_jax.rollout.interfaces import Environment


def _checkpoint_chat(config) -> Optional[TemplateChat]:
    """``model.chat_template``: "" renders the hand-written ChatML (``ChatFormat``); "checkpoint"
    renders with the checkpoint's own jinja template (``TemplateChat``)."""
    m = config.model
    if m.chat_template not in ("", "checkpoint"):
        raise ValueError(
            f"model.chat_template must be '' (hand-written ChatML) or 'checkpoint', got {m.chat_template!r}"
        )
    if m.chat_template != "checkpoint":
        return None
    if not m.checkpoint:
        raise ValueError(
            "model.chat_template='checkpoint' needs model.checkpoint (a directory with tokenizer_config.json)"
        )
    if m.assistant_prefix:
        raise ValueError(
            "model.assistant_prefix applies to the hand-written ChatML only; with model.chat_template="
            "'checkpoint' the template's generation prompt is used"
        )
    return TemplateChat.from_checkpoint(m.checkpoint)


def resolve_tool_prompt(config) -> str:
    """``env.tool_prompt``, with "auto" resolved: "template" when the checkpoint's chat template renders
    the tools, else "schemas" (the tools described in the system message)."""
    tool_prompt = config.env.tool_prompt
    chat = _checkpoint_chat(config) if tool_prompt in ("auto", "template") else None
    if tool_prompt == "auto":
        return "template" if chat is not None and chat.renders_tools else "schemas"
    if tool_prompt == "template" and (chat is None or not chat.renders_tools):
        raise ValueError(
            "env.tool_prompt='template' needs model.chat_template='checkpoint' with a chat template that renders "
            "tools" + ("" if chat is None else f" (the one in {config.model.checkpoint} does not)")
        )
    return tool_prompt


def build_chat(
    config,
    workdir: pathlib.Path,
    collections: Mapping[str, Collection],
    env: Environment,
    train_if_missing: bool = True,
) -> ChatFormat:
    """The checkpoint's tokenizer (rendered with its own chat template for ``model.chat_template=
    "checkpoint"``), ``model.tokenizer``, or (the tiny default) ``<workdir>/tokenizer.json``,
    trained on the corpus and the protocol's strings the first time and reused on resume."""
    templated = _checkpoint_chat(config)
    if templated is not None:
        return templated
    prefix = config.model.assistant_prefix
    if config.model.tokenizer:
        return ChatFormat.from_file(config.model.tokenizer, prefix)
    if config.model.checkpoint:
        path = pathlib.Path(config.model.checkpoint) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: not found; set model.tokenizer")
        return ChatFormat.from_file(path, prefix)
    saved = workdir / "tokenizer.json"
    exists = saved.exists()
    distributed.barrier("tokenizer-looked")  # every process looked before the primary may write it
    if exists:  # resume with the very same tokenizer
        return ChatFormat.from_file(saved, prefix)
    if not train_if_missing:
        raise FileNotFoundError(f"{saved}: not found (the tiny model's tokenizer is trained by experiments.run)")
    if not distributed.is_primary():  # the other processes read the primary's, through the shared work directory
        distributed.barrier("tokenizer-written")
        return ChatFormat.from_file(saved, prefix)
    texts = []
    for c in collections.values():
        texts += [f"{d.doc_id} {d.title} {d.text}" for d in c.documents]
        texts += [t.query for t in c.tasks]
        _, messages = env.reset(c.tasks[0])
        texts += [m["content"] for m in messages] * 20
    tokenizer = train_tokenizer(texts + tokenizer_seed_texts(csv(config.search.tools)), config.model.tiny_vocab)
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(saved))
    distributed.barrier("tokenizer-written")
    return ChatFormat(tokenizer, prefix)
