"""Sampling defaults from generation_config.json and --chat-template, through a real server."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from hybridlb.api.openai.schemas import CompletionRequest
from hybridlb.checkpoint.generation_config import sampling_defaults
from hybridlb.checkpoint.path import CheckpointError
from hybridlb.testing.servers import start_server

TEMPLATE = "{% if messages[0].content == 'boom' %}{{ raise_exception('no explosions here') }}{% endif %}" \
           "{% if tools %}[{{ tools | length }} tools] {% endif %}" \
           "{% if greeting is defined %}{{ greeting }} {% endif %}" \
           "Q: {{ messages[-1].content }}\nA:"


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory, tiny_qwen3):
    """A copy of the tiny model whose generation_config.json makes decoding greedy."""
    model = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 20}))
    return model


@pytest.fixture(scope="module")
def server(greedy_by_default, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "qa.jinja"
    template.write_text(TEMPLATE)
    server = start_server(str(greedy_by_default), "--chat-template", str(template))
    yield server
    assert server.stop() == 0


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": server.model, **body}, timeout=60)


def test_chat_uses_the_template_given_on_the_command_line(server, greedy_by_default):
    from hybridlb.checkpoint.tokenizer import Tokenizer

    response = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                   "max_tokens": 2})
    assert response.status_code == 200, response.text
    tokenizer = Tokenizer(greedy_by_default)
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("Q: Hello\nA:", add_special_tokens=False))
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in "fg"]
    response = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                                                   "tools": tools, "tool_choice": "none",
                                                   "chat_template_kwargs": {"greeting": "Hi!"}})
    expected = tokenizer.encode("[2 tools] Hi! Q: Hello\nA:", add_special_tokens=False)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(expected)
    failing = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "boom"}]})
    assert failing.status_code == 400 and "no explosions here" in failing.json()["error"]["message"]


def test_generation_config_settings(greedy_by_default, tmp_path):
    assert sampling_defaults(greedy_by_default) == {"temperature": 0.0, "top_k": 20}
    assert sampling_defaults(greedy_by_default, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.9, "repetition_penalty": 1.1}))
    assert sampling_defaults(greedy_by_default, str(tmp_path)) == {"top_p": 0.9, "repetition_penalty": 1.1}
    with pytest.raises(CheckpointError, match=r"--generation-config .*: .* does not exist; pass auto, vllm"):
        sampling_defaults(greedy_by_default, str(tmp_path / "none"))
    body = CompletionRequest(model="m", prompt="x", temperature=0.5)
    params = body.sampling_params(16, {"temperature": 0.0, "top_p": 0.9})
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 0)
