"""Sampling defaults from generation_config.json and --chat-template, through a real server."""

# ruff: noqa: F811 - the fixtures imported from this file's unit-tier half are parameters here
from __future__ import annotations

import subprocess
import sys

from hybridlb import LLM, SamplingParams
from tests.unit.api.test_model_options import TEMPLATE, _post, greedy_by_default, server  # noqa: F401 - fixtures: greedy_by_default, server


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
