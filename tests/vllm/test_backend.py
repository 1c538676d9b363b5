"""`hybridlb serve --engine-backend vllm` against vLLM itself: the real SmolLM2 (the Hugging Face
directory made from the bundled GGUF), greedy completions and chats sent one at a time, token for
token equal to `vllm serve` of the same vLLM release, in float32 and bfloat16. Both sides run eager
(vLLM's torch.compile warm-up takes ~70 s per start on 2 cores and changes no token)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from hybridlb.testing.servers import Server, start_servers

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about the sea:\n",
    "Translate to French: Good morning, my friend.",
    "The first step to learning a language is",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain on Earth?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Name three fruits."}, {"role": "assistant", "content": "Apple, banana, cherry."},
     {"role": "user", "content": "And three vegetables?"}],
]
COMMON = ("--max-model-len", "1024", "--enforce-eager", "--served-model-name", "smollm2")


def _answers(url: str) -> dict[str, list]:
    """Greedy texts, finish reasons and token counts (prompt and output: the same chat template and
    tokens on both sides) of every prompt and chat, one request at a time."""
    found: dict[str, list] = {"completions": [], "chats": []}
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt in PROMPTS:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            answer = _ok(client.post("/v1/completions", json=body))
            choice = answer["choices"][0]
            found["completions"].append((choice["text"], choice["finish_reason"], _counts(answer)))
        for messages in CHATS:
            body = {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
            answer = _ok(client.post("/v1/chat/completions", json=body))
            choice = answer["choices"][0]
            found["chats"].append((choice["message"]["content"], choice["finish_reason"], _counts(answer)))
    return found


def _counts(answer: dict) -> tuple[int, int]:
    return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]


def _ok(response: httpx.Response, server: Server | None = None) -> dict:
    """The answer's JSON; on an error, its body and the end of the server's output (an engine's death)."""
    assert response.status_code == 200, response.text + (f"\n{server.output[-6000:]}" if server else "")
    return response.json()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request, smollm2_hf_dir, vllm_command, tmp_path_factory):
    """(vLLM's answers, hybridlb's server with the vLLM backend) in one dtype; each server alone."""
    dtype = request.param
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    (reference,) = start_servers(Server.vllm(f"vllm-{dtype}", vllm_command, smollm2_hf_dir, "--dtype", dtype,
                                             "--enforce-eager", "--served-model-name", "smollm2", env=env,
                                             log_dir=tmp_path_factory.mktemp("vllm")), timeout_s=300)
    try:
        expected = _answers(reference.url)
    finally:
        reference.stop()
    (server,) = start_servers(Server(smollm2_hf_dir, "--engine-backend", "vllm", "--dtype", dtype, *COMMON,
                                     "--kv-cache-gib", "1"), timeout_s=300)
    yield expected, server
    server.stop()


def test_greedy_completions_and_chats_equal_vllm_serve(pair):
    expected, server = pair
    got = _answers(server.url)
    assert any(reason == "length" for _, reason, _ in got["completions"])
    for i, (ours, theirs) in enumerate(zip(got["completions"], expected["completions"], strict=True)):
        assert ours == theirs, (PROMPTS[i], ours, theirs)
    for i, (ours, theirs) in enumerate(zip(got["chats"], expected["chats"], strict=True)):
        assert ours == theirs, (CHATS[i], ours, theirs)
    assert "vLLM 0.32.0 engine core" in server.output


def test_streaming_equals_non_streaming_and_logprobs_come_through(pair):
    _, server = pair
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for prompt in PROMPTS[:3]:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
            whole = _ok(client.post("/v1/completions", json=body), server)["choices"][0]
            parts, reason = [], None
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"][0]
                        parts.append(choice["text"])
                        reason = choice.get("finish_reason") or reason
            assert "".join(parts) == whole["text"] and reason == whole["finish_reason"]
            tops = whole["logprobs"]["top_logprobs"]
            assert len(tops) == len(whole["logprobs"]["tokens"]) and all(len(top) >= 2 for top in tops)
            assert all(lp <= 0 for lp in whole["logprobs"]["token_logprobs"])  # greedy: the most likely, ~0


def test_a_json_schema_response_validates(pair):
    _, server = pair
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    body = {"model": "smollm2", "max_tokens": 80, "temperature": 0,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
    choice = _ok(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120), server)["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
