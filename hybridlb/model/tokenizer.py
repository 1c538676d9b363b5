"""Tokenizer of a checkpoint: tokenizer.json, its config (chat template, special
tokens) and the eos ids of generation_config.json. Shared by the API server (which
tokenizes and detokenizes) and the offline API; engines read only the eos ids.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from hybridlb.model.spec import CheckpointError


def _read_json(path: Path) -> dict:
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


def _raise(message: str):
    raise TemplateError(message)


def read_eos_token_ids(model_dir: str | Path) -> list[int]:
    """End-of-sequence ids from generation_config.json, else config.json (engines use this)."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(model_dir / name).get("eos_token_id")
        if eos is not None:
            return sorted(set(eos if isinstance(eos, list) else [eos]))
    return []


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: hybridlb needs a fast tokenizer (tokenizer.json)")
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be loaded: {exc}") from None
        self.config = _read_json(model_dir / "tokenizer_config.json")
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.chat_template = self.config.get("chat_template")
        self.eos_token_ids = read_eos_token_ids(model_dir)
        if not self.eos_token_ids and self.eos_token:
            token_id = self._tok.token_to_id(self.eos_token)
            self.eos_token_ids = [] if token_id is None else [token_id]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages to a prompt string with the checkpoint's template."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template; use completions")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
