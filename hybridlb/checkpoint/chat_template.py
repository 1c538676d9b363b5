"""Chat templates rendered as transformers renders them.

Real templates rely on what transformers' template environment provides: a sandboxed
Jinja with ``trim_blocks`` / ``lstrip_blocks``, loop controls (``{% break %}``), a
``tojson`` that keeps non-ASCII text, ``raise_exception(msg)``, ``strftime_now(fmt)``,
the ``{% generation %}`` tag, and the special tokens, ``tools`` and ``documents`` as
variables. Matching it exactly means a prompt here is the prompt the model was tuned on.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import ClassVar

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridlb.checkpoint.path import CheckpointError


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here
    it renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    return env


class ChatTemplate:
    """A compiled template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            raise CheckpointError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = {name: value or "" for name, value in special_tokens.items()}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None, **kwargs) -> str:
        """The prompt text for ``messages``; extra ``kwargs`` (chat_template_kwargs) reach the template."""
        return self._template.render(
            **{**self.special_tokens, **kwargs}, messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt,
        )


def read_template_argument(value: str) -> str:
    """``--chat-template``: a file's contents, or the template text itself (as vLLM accepts)."""
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise CheckpointError(f"chat template file {value} does not exist; pass a .jinja file or the template text")


def checkpoint_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """The template a Hugging Face directory ships: ``chat_template.jinja`` (transformers 5),
    else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
