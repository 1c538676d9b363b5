"""Hugging Face hub IDs (``org/name``) served from the local Hugging Face cache, offline, as vLLM
does: the cache laid out as `hf download` leaves it (blobs, snapshot symlinks, refs), revisions,
a model that is not there, --tokenizer, and a real server answering to the ID."""

# ruff: noqa: F811 - the fixtures imported from this file's unit-tier half are parameters here
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from hybridlb.testing.servers import Server, completion, start_servers
from tests.unit.test_hub_models import MAIN, REPO, V2, _snapshot, cache_repo, hf_home  # noqa: F401 - fixtures: hf_home


def _offline(hf_home: Path) -> dict[str, str]:
    """The environment of a machine without internet whose cache is ``hf_home`` (empty: not set)."""
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_CACHE": "", "HUGGINGFACE_HUB_CACHE": "",
            "HF_HUB_OFFLINE": "1"}


def _hybridlb(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def test_serve_dry_run_resolves_a_hub_id_from_the_cache_offline(hf_home, tmp_path):
    run = _hybridlb("serve", REPO, "--dry-run", env=_offline(hf_home), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "model ['acme/tiny-qwen']" in run.stdout  # served as typed
    assert f"model acme/tiny-qwen (revision main): {_snapshot(hf_home, MAIN)}" in run.stderr
    assert "max_model_len 2048 (the model's)" in run.stdout
    config = tmp_path / "hub.yaml"
    config.write_text(f"engine: {{model: {REPO}}}\n")
    from_file = _hybridlb("plan", "--config", str(config), env=_offline(hf_home), cwd=tmp_path)
    assert from_file.returncode == 0, from_file.stderr
    assert str(_snapshot(hf_home, MAIN)) in from_file.stderr


def test_revision_picks_another_snapshot(hf_home, tmp_path):
    for revision in ("v2", V2):
        run = _hybridlb("serve", REPO, "--revision", revision, "--dry-run", env=_offline(hf_home), cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "max_model_len 1000 (the model's)" in run.stdout
        assert str(_snapshot(hf_home, V2)) in run.stderr
    missing = _hybridlb("serve", REPO, "--revision", "v9", "--dry-run", env=_offline(hf_home), cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "revision v9 is not in the Hugging Face cache" in missing.stderr
    assert "refs [main, v2]" in missing.stderr and "hf download acme/tiny-qwen --revision v9" in missing.stderr


def test_a_model_missing_from_the_cache_names_the_paths_looked_at(hf_home, tmp_path):
    run = _hybridlb("serve", "acme/absent", "--dry-run", env=_offline(hf_home), cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    message = " ".join(run.stderr.split())  # typer wraps nothing, but be safe
    assert "model acme/absent does not exist" in message
    assert str(tmp_path / "acme/absent") in message  # the local path looked at
    assert str(hf_home / "hub" / "models--acme--absent") in message and "from $HF_HOME" in message
    assert "hf download acme/absent" in message and "local checkpoint directory" in message
    elsewhere = {**_offline(hf_home), "HF_HUB_CACHE": str(tmp_path / "cache")}
    run = _hybridlb("serve", REPO, "--dry-run", env=elsewhere, cwd=tmp_path)
    assert run.returncode == 2 and str(tmp_path / "cache" / "models--acme--tiny-qwen") in run.stderr


def test_tokenizer_is_accepted_only_as_the_models_own(hf_home, tmp_path, checkpoints):
    env = _offline(hf_home)
    for same in (REPO, str(_snapshot(hf_home, MAIN))):
        run = _hybridlb("serve", REPO, "--tokenizer", same, "--dry-run", env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    other = _hybridlb("serve", REPO, "--tokenizer", checkpoints("llama"), "--dry-run", env=env, cwd=tmp_path)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert f"--tokenizer {checkpoints('llama')}" in other.stderr and "is not the model's own checkpoint" in other.stderr


def test_serve_answers_to_the_hub_id(hf_home):
    server = start_servers(Server(REPO, "--data-parallel-size", "1", env=_offline(hf_home)))[0]
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        assert [card["id"] for card in models["data"]] == [REPO]
        answer = completion(server.url, REPO, max_tokens=3)
        assert answer["model"] == REPO and answer["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
