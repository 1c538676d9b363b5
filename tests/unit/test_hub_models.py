"""Hugging Face hub IDs (``org/name``) served from the local Hugging Face cache, offline, as vLLM
does: the cache laid out as `hf download` leaves it (blobs, snapshot symlinks, refs), revisions,
a model that is not there, --tokenizer, and a real server answering to the ID."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from hybridlb.checkpoint.hub import cache_dir
from hybridlb.checkpoint.path import CheckpointError, resolve
from hybridlb.checkpoint.pin import pin_hub_model
from hybridlb.config import parse_config

REPO = "acme/tiny-qwen"
MAIN = "a" * 40
V2 = "b" * 40  # tag v2: the same weights, max_position_embeddings 1000


def cache_repo(hub: Path, repo_id: str, checkpoint: Path, commit: str, refs: list[str]) -> Path:
    """``checkpoint``'s files in ``hub`` as `hf download` lays them out: content-named blobs, a snapshot of
    relative symlinks into them, and each of ``refs`` naming ``commit``; the snapshot directory."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(checkpoints, tmp_path_factory) -> Path:
    """An HF_HOME holding acme/tiny-qwen: main, and tag v2 with another max length."""
    home = tmp_path_factory.mktemp("hf_home")
    tiny = Path(checkpoints("qwen3"))
    cache_repo(home / "hub", REPO, tiny, MAIN, ["main"])
    other = tmp_path_factory.mktemp("v2") / "tiny"
    shutil.copytree(tiny, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1000}))
    cache_repo(home / "hub", REPO, other, V2, ["v2"])
    return home


def _snapshot(hf_home: Path, commit: str) -> Path:
    return hf_home / "hub" / "models--acme--tiny-qwen" / "snapshots" / commit


def test_resolve_reads_the_cache_the_environment_names(hf_home, tmp_path, monkeypatch):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir()[0] == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    assert resolve(REPO).path == _snapshot(hf_home, MAIN)
    assert resolve(REPO, "v2").path == _snapshot(hf_home, V2)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # HF_HUB_CACHE wins over HF_HOME
    with pytest.raises(CheckpointError, match="models--acme--tiny-qwen"):
        resolve(REPO)


def test_the_config_keeps_the_snapshot_and_serves_the_id(hf_home, tmp_path, monkeypatch, checkpoints):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.chdir(tmp_path)
    pinned, note = pin_hub_model(parse_config({"engine": {"model": REPO}}))
    assert pinned.engine.model == str(_snapshot(hf_home, MAIN)) and pinned.served_model_names == [REPO]
    named, _ = pin_hub_model(parse_config({"engine": {"model": REPO}, "api": {"served_model_name": "tiny"}}))
    assert named.served_model_names == ["tiny"]
    local, note = pin_hub_model(parse_config({"engine": {"model": checkpoints("qwen3"), "revision": "v2"}}))
    assert local.engine.model == checkpoints("qwen3") and "--revision v2 has no effect" in note
    absent, note = pin_hub_model(parse_config({"engine": {"model": "acme/absent"}}))  # `plan` goes on without it
    assert absent.engine.model == "acme/absent" and note is None


def test_a_hub_repo_holding_one_gguf_resolves_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    files = tmp_path / "files"
    files.mkdir()
    (files / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    snapshot = cache_repo(tmp_path / "hub", "acme/tiny-gguf", files, MAIN, ["main"])
    assert resolve("acme/tiny-gguf").path == snapshot / "tiny.Q4_0.gguf"


def test_the_offline_llm_takes_a_hub_id_at_a_revision(hf_home, tmp_path, monkeypatch):
    """`LLM("org/name", revision=...)` loads that snapshot, as the command line does."""
    from hybridlb import LLM

    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.chdir(tmp_path)
    assert LLM(REPO, revision="v2").engine.max_model_len == 1000
    assert LLM(REPO).engine.max_model_len != 1000
