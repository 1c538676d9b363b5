"""Sampling defaults from generation_config.json and --chat-template, through a real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from hybridlb import LLM, SamplingParams
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


def test_unset_sampling_fields_take_the_models_defaults(server, greedy_by_default):
    greedy = LLM(str(greedy_by_default), max_model_len=512, num_kv_blocks=64, dtype="float32").generate(
        "The weather today", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    body = {"prompt": "The weather today", "max_tokens": 12, "ignore_eos": True}
    texts = {_post(server, "completions", {**body, "seed": seed}).json()["choices"][0]["text"] for seed in (1, 2, 3)}
    assert texts == {greedy}  # temperature 0 from generation_config.json: seeds do not matter
    explicit_null = _post(server, "completions", {**body, "temperature": None}).json()["choices"][0]["text"]
    assert explicit_null == greedy


def test_serve_refuses_a_missing_chat_template_before_starting(tiny_qwen3, tmp_path):
    run = subprocess.run([sys.executable, "-m", "hybridlb", "serve", "--model", tiny_qwen3, "--chat-template",
                          str(tmp_path / "missing.jinja")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "missing.jinja does not exist" in run.stderr and "Traceback" not in run.stderr
