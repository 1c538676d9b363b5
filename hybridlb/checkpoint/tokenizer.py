"""Tokenizer of a checkpoint: tokenizer.json with its config (special tokens, chat template)
and the eos ids of generation_config.json — or all of that from a GGUF file's metadata.
Shared by the API server (which tokenizes and detokenizes) and the offline API; engines
read only the eos ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

from hybridlb.checkpoint.chat_template import ChatTemplate, checkpoint_template
from hybridlb.checkpoint.path import CheckpointError, resolve

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def read_json(path: Path) -> dict:
    """A JSON side file of a checkpoint, ``{}`` when absent."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def _token_text(value: object) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_eos_token_ids(model: str | Path) -> list[int]:
    """End-of-sequence ids from generation_config.json, else config.json, else the GGUF metadata."""
    checkpoint = resolve(model)
    if checkpoint.is_gguf:
        from hybridlb.checkpoint.gguf import gguf_eos_token_ids

        return gguf_eos_token_ids(checkpoint.path)
    for name in ("generation_config.json", "config.json"):
        eos = read_json(checkpoint.path / name).get("eos_token_id")
        if eos is not None:
            return sorted(set(eos if isinstance(eos, list) else [eos]))
    return []


def _load_hf(model_dir: Path) -> tuple[RustTokenizer, dict]:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: hybridlb needs a fast tokenizer (tokenizer.json)")
    try:
        tokenizer = RustTokenizer.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from None
    config = read_json(model_dir / "tokenizer_config.json")
    config = {**config, **{name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}}
    config["chat_template"] = checkpoint_template(model_dir, config)
    return tokenizer, config


class Tokenizer:
    """``chat_template`` (template text) replaces the checkpoint's own, as ``--chat-template`` does."""

    def __init__(self, model: str | Path, chat_template: str | None = None):
        checkpoint = resolve(model)
        if checkpoint.is_gguf:
            from hybridlb.checkpoint.gguf import gguf_tokenizer

            self._tok, self.config = gguf_tokenizer(checkpoint.path)
        else:
            self._tok, self.config = _load_hf(checkpoint.path)
        self.eos_token = self.config.get("eos_token")
        self.bos_token = self.config.get("bos_token")
        template = chat_template or self.config.get("chat_template")
        self.chat_template_text: str | None = template
        specials = {name: self.config.get(name) for name in SPECIAL_TOKEN_NAMES}
        self.chat_template = ChatTemplate(template, specials) if template else None
        self.eos_token_ids = read_eos_token_ids(model)
        if not self.eos_token_ids and self.eos_token:
            token_id = self._tok.token_to_id(self.eos_token)
            self.eos_token_ids = [] if token_id is None else [token_id]

    @property
    def rust(self) -> RustTokenizer:
        """The ``tokenizers`` object (grammar libraries build their own view of the vocabulary from it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render chat messages to a prompt string with the checkpoint's template; ``kwargs``
        (tools, documents, chat_template_kwargs) reach the template."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (no chat_template.jinja, none in "
                             "tokenizer_config.json or the GGUF file); start the server with "
                             "--chat-template FILE, or use /v1/completions")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
