"""Hugging Face hub IDs (``org/name``) taken from this machine's Hugging Face cache; nothing is downloaded.

The cache is the directory ``hf download`` fills: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``. A repository lives in ``models--ORG--NAME/`` there: ``refs/BRANCH``
(or tag) holds a commit hash, ``snapshots/COMMIT/`` the files (symlinks into ``blobs/``).

``snapshot`` finds the directory a hub ID and a revision name. ``pin.pin_hub_model`` puts it into the
config once, where the config is built: every process of the tree (engines, API servers, Ray
actors) then loads that one directory, even if the cache moves on meanwhile, and clients keep
sending the ID as typed, which stays the served name (as with vLLM).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hybridlb.checkpoint.errors import CheckpointError
from hybridlb.config import MODEL_ALIASES

DEFAULT_REVISION = "main"
_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
_HUB_ID = re.compile(rf"(?:{_PART}/)?{_PART}")


def names_hub_model(text: str) -> bool:
    """Whether a model argument is taken as a hub ID: ``org/name`` or ``name``, and no local path or short name."""
    return (bool(_HUB_ID.fullmatch(text)) and "--" not in text and ".." not in text and not text.endswith(".gguf")
            and text.lower() not in MODEL_ALIASES and not Path(text).exists())


def cache_dir() -> tuple[Path, str]:
    """The hub cache this process reads, and what chose it (for error messages)."""
    for variable, below in (("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub")):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser() / below, f"${variable}"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub", "$XDG_CACHE_HOME"
    return Path.home() / ".cache" / "huggingface" / "hub", "the default; set HF_HOME or HF_HUB_CACHE for another"


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit hash; default main)."""
    revision = revision or DEFAULT_REVISION
    if Path(revision).is_absolute() or ".." in Path(revision).parts:
        raise CheckpointError(f"--revision {revision!r}: give a branch, tag or commit hash")
    cache, chosen_by = cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        raise CheckpointError(
            f"model {repo_id} does not exist: it is not a local path (looked at {Path(repo_id).absolute()}) and "
            f"not in the Hugging Face cache (looked at {repo}; cache {cache} from {chosen_by}). "
            f"{_fix(repo_id, revision)}{_short_names(repo_id)}")
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo / "snapshots" / commit
    if not folder.is_dir():
        if ref.is_file():
            where = f"{ref} names commit {commit}, but {folder} is missing (an interrupted download?)"
        else:
            where = f"no {ref} and no {folder}; cached: {_cached(repo)}"
        raise CheckpointError(f"model {repo_id} at revision {revision} is not in the Hugging Face cache: {where}. "
                              + _fix(repo_id, revision))
    if not (folder / "config.json").is_file() and not any(folder.glob("*.gguf")):
        raise CheckpointError(f"model {repo_id} at revision {revision}: {folder} holds neither config.json nor a "
                              ".gguf file (a partial download, or a broken link into blobs/). "
                              + _fix(repo_id, revision))
    return folder


def _fix(repo_id: str, revision: str) -> str:
    again = "" if revision == DEFAULT_REVISION else f" --revision {revision}"
    return (f"Nothing is ever downloaded: on a machine with internet run `hf download {repo_id}{again}` (older "
            f"huggingface_hub: `huggingface-cli download`) and copy its cache here (or point HF_HOME at it), or "
            "pass a local checkpoint directory")


def _short_names(repo_id: str) -> str:
    return "" if "/" in repo_id else f" (short names of bundled models: {', '.join(MODEL_ALIASES)})"


def _cached(repo: Path) -> str:
    refs = sorted(str(p.relative_to(repo / "refs")) for p in (repo / "refs").rglob("*") if p.is_file())
    commits = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    return f"refs [{', '.join(refs)}], snapshots [{', '.join(commits)}]"
