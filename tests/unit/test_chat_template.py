"""Chat templates render exactly what transformers renders, from wherever a checkpoint keeps
them; a missing or failing template is a clear error."""

from __future__ import annotations

import json
import shutil

import pytest
from jinja2 import TemplateError

from hybridlb.checkpoint.chat_template import read_template_argument
from hybridlb.checkpoint.path import CheckpointError
from hybridlb.checkpoint.tokenizer import Tokenizer

# Everything real templates lean on: loop controls, namespace, tojson of non-ASCII text,
# strftime_now, raise_exception, tools, documents, the generation tag and special tokens.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}
{%- if documents %}{% for d in documents %}[doc {{ loop.index }}: {{ d.title }}]{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
{%- if loop.index > 3 %}{% break %}{% endif %}
{%- if m.role == 'system' %}{% set ns.n = ns.n + 1 %}{% continue %}{% endif %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}systems={{ ns.n }} year={{ strftime_now('%Y') }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # noqa: E501 - the template is one line per construct
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Zürich café 中文?"},
    {"role": "assistant", "content": "Oui."},
    {"role": "user", "content": "never rendered: the loop breaks first"},
]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Weather in a city", "parameters": CITY}}]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."}, {"title": "Lyon", "text": "Food."}]


@pytest.fixture
def model_copy(tmp_path, tiny_qwen3):
    target = tmp_path / "model"
    shutil.copytree(tiny_qwen3, target)
    return target


def _transformers(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_rich_template_renders_as_in_transformers(model_copy):
    (model_copy / "chat_template.jinja").write_text(RICH_TEMPLATE)
    theirs = _transformers(model_copy)
    ours = Tokenizer(model_copy)
    for kwargs in ({}, {"tools": TOOLS}, {"documents": DOCUMENTS}, {"tools": TOOLS, "documents": DOCUMENTS}):
        expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(MESSAGES, **kwargs) == expected
    assert "météo" in ours.apply_chat_template(MESSAGES, tools=TOOLS)  # tojson keeps non-ASCII text
    with pytest.raises(TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sources_in_order_of_precedence(model_copy, tmp_path):
    config_path = model_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    chat = [{"role": "user", "content": "Hi"}]
    assert Tokenizer(model_copy).apply_chat_template(chat) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "NAMED"}]
    config_path.write_text(json.dumps(config))
    assert Tokenizer(model_copy).apply_chat_template(chat) == "NAMED"
    (model_copy / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    assert Tokenizer(model_copy).apply_chat_template(chat) == "JINJA Hi"
    flag = tmp_path / "mine.jinja"
    flag.write_text("FLAG {{ messages | length }}")
    assert Tokenizer(model_copy, read_template_argument(str(flag))).apply_chat_template(chat) == "FLAG 1"
    assert read_template_argument("{{ 'inline' }}") == "{{ 'inline' }}"


def test_missing_templates_name_the_fix(model_copy, tmp_path):
    config_path = model_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no chat template .* --chat-template FILE, or use /v1/completions"):
        Tokenizer(model_copy).apply_chat_template([{"role": "user", "content": "Hi"}])
    with pytest.raises(CheckpointError, match=r"chat template file .*nope\.jinja does not exist"):
        read_template_argument(str(tmp_path / "nope.jinja"))
    (model_copy / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(CheckpointError, match="the chat template does not compile"):
        Tokenizer(model_copy)
