"""vLLM's runtime LoRA endpoint (/v1/load_lora_adapter) as a client can reach it: it reads only
under the allowed roots, every path with no adapter to read gets the same error (so the errors
map nothing of the server's files), files are read up to a cap, and a malformed adapter inside
the root is a 400 naming its problem, never a 500. In process: the endpoint needs no engine."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hybridlb.api.app import create_app
from hybridlb.api.spec import ApiServerSpec
from hybridlb.config import parse_config
from hybridlb.testing.adapters import write_adapter

PLACEHOLDER = b"<path>"


@pytest.fixture
def dirs(checkpoints, tmp_path, monkeypatch) -> tuple[str, Path, Path]:
    """The model, an allowed root holding the adapter ``good``, and a directory outside it
    holding another (``other``)."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    model = checkpoints("llama")
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_adapter(root / "good", model, ["q_proj"])
    write_adapter(outside / "other", model, ["q_proj"])
    return model, root, outside


def _client(model: str, **lora) -> TestClient:
    config = parse_config({"engine": {"model": model, "lora": lora}})
    return TestClient(create_app(config, ApiServerSpec(engines=((0, "ipc:///nowhere"),))))


def _load(client: TestClient, path: str | Path, name: str = "x"):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def _message(response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_every_path_without_an_adapter_gets_byte_identical_errors(dirs):
    model, root, outside = dirs
    (root / "file.txt").write_text("not an adapter")
    (root / "empty").mkdir()
    (root / "link").symlink_to(outside / "other")
    unreadable = write_adapter(root / "unreadable", model, ["q_proj"])
    (unreadable / "adapter_config.json").chmod(0)
    bad = [root / "missing", root / "file.txt", root / "empty", root / "empty" / "adapter_config.json",
           outside / "other", f"{root}/../outside/other", root / "link", "/etc", "/", "root/\x00/x"]
    if os.geteuid() != 0:  # root reads a file of mode 000
        bad.append(unreadable)
    client = _client(model, allowed_roots=[str(root)])
    bodies = set()
    for path in map(str, bad):
        response = _load(client, path)
        assert response.status_code == 400, (path, response.text)
        bodies.add(response.content.replace(json.dumps(path)[1:-1].encode(), PLACEHOLDER))
    assert len(bodies) == 1, bodies
    message = json.loads(bodies.pop())["error"]["message"]
    assert message == ("adapter 'x': no loadable LoRA adapter at <path> under the allowed roots "
                       "(--lora-allowed-root, engine.lora.allowed_roots)")
    assert _load(client, root / "good").status_code == 200
    assert _load(client, f"{root}/empty/../good", "y").status_code == 200  # `..` that stays inside is fine
    too_long = _message(_load(client, "/" + "a" * 5000))
    assert "lora_path" in too_long and "4096" in too_long


def test_the_default_root_is_the_directory_of_the_lora_modules(dirs):
    model, root, outside = dirs
    write_adapter(root / "second", model, ["v_proj"])
    client = _client(model, modules=[{"name": "good", "path": str(root / "good")}])
    assert _load(client, root / "second").status_code == 200
    refused = _message(_load(client, outside / "other", "other"))
    assert refused.startswith("adapter 'other': no loadable LoRA adapter at ")


def test_with_no_root_runtime_loading_refuses_every_path_naming_the_option(dirs):
    model, root, _ = dirs
    client = _client(model)
    message = _message(_load(client, root / "good"))
    assert "--lora-allowed-root" in message and "engine.lora.allowed_roots" in message


def _adapter_with(root: Path, model: str, name: str, config: bytes | None = None,
                  weights: bytes | None = None) -> Path:
    """A good adapter whose adapter_config.json or adapter_model.safetensors is then replaced."""
    directory = write_adapter(root / name, model, ["q_proj"])
    if config is not None:
        (directory / "adapter_config.json").write_bytes(config)
    if weights is not None:
        (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


def _safetensors(header: object, data: bytes = b"", claimed: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if claimed is None else claimed) + text + data


def test_a_malformed_adapter_inside_the_root_is_a_precise_400(dirs):
    model, root, _ = dirs
    good = root / "good"
    config = (good / "adapter_config.json").read_bytes()
    weights = (good / "adapter_model.safetensors").read_bytes()
    (header_size,) = struct.unpack("<Q", weights[:8])
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "big_config": (dict(config=config + b" " * 2**16), "adapter_config.json is larger than 64 KiB"),
        "bad_json": (dict(config=b"{"), "adapter_config.json is not valid JSON"),
        "nested_json": (dict(config=b"[" * 50_000), "adapter_config.json is not valid JSON"),
        "bad_alpha": (dict(config=b'{"lora_alpha": "high"}'), "lora_alpha must be a number"),
        "bad_header": (dict(weights=_safetensors({key: 5})), f"tensor '{key}' has no known dtype"),
        "header_not_object": (dict(weights=_safetensors([1, 2])), "its header is not a JSON object"),
        "header_not_json": (dict(weights=struct.pack("<Q", 4) + b"\xff\xfe{["), "its header is not JSON"),
        "big_header": (dict(weights=_safetensors({}, b" " * 5 * 2**20, claimed=5 * 2**20 + 2)),
                       "its header claims 5242882 bytes, more than the 4194304"),
        "cut_in_header": (dict(weights=weights[:20]), "it is truncated (20 bytes, shorter than its header)"),
        "cut_in_data": (dict(weights=weights[:-100]), "lies past the end of the file"),
        "eight_bytes_short": (dict(weights=weights[:5]), "it is truncated"),
    }
    assert header_size < len(weights) - 100  # cut_in_data keeps the header whole
    client = _client(model, allowed_roots=[str(root)])
    for name, (files, expected) in cases.items():
        path = _adapter_with(root, model, name, **files)
        message = _message(_load(client, path, name))
        assert expected in message and str(path) in message, (name, message)
