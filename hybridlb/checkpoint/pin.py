"""A hub ID as model, pinned into the config once where it is built (``hub`` finds the snapshot):
every process of the tree then loads that one directory, and clients keep sending the ID as
typed, which stays the served name."""

from __future__ import annotations

from hybridlb.checkpoint.errors import CheckpointError
from hybridlb.checkpoint.hub import DEFAULT_REVISION, names_hub_model, snapshot
from hybridlb.checkpoint.path import resolve
from hybridlb.config import Config, EngineConfig


def pin_hub_model(cfg: Config) -> tuple[Config, str | None]:
    """``cfg`` with a hub ID in engine.model replaced by its cached snapshot directory (the ID kept as the
    served name), and a note for the user (None: nothing to say).

    A hub model not in the cache is left as it is, for the commands that load it to refuse (``plan`` draws
    the rank map without it), unless --revision or --tokenizer ask about the checkpoint: then CheckpointError.
    """
    engine = cfg.engine
    if engine.make_if_missing is not None or not names_hub_model(engine.model):
        _check_tokenizer(engine, engine.model)
        if engine.revision is None:
            return cfg, None
        return cfg, f"--revision {engine.revision} has no effect: model {engine.model} is local, not a hub ID"
    try:
        folder = snapshot(engine.model, engine.revision)
    except CheckpointError:
        if engine.revision is None and engine.tokenizer is None:
            return cfg, None
        raise
    _check_tokenizer(engine, str(folder))
    served = cfg.api.served_model_name or engine.model
    pinned = cfg.model_copy(update={"engine": engine.model_copy(update={"model": str(folder)}),
                                    "api": cfg.api.model_copy(update={"served_model_name": served})})
    revision = engine.revision or DEFAULT_REVISION
    return pinned, f"model {engine.model} (revision {revision}): {folder}, from the Hugging Face cache"


def _check_tokenizer(engine: EngineConfig, model: str) -> None:
    """Refuse a --tokenizer other than the model's own: the tokenizer is always read from the checkpoint served."""
    if engine.tokenizer is None or engine.tokenizer == engine.model:
        return
    theirs = resolve(engine.tokenizer, engine.revision).path.resolve()
    ours = resolve(model).path.resolve()
    if theirs != ours:
        raise CheckpointError(f"--tokenizer {engine.tokenizer} ({theirs}) is not the model's own checkpoint ({ours}): "
                              "hybridlb reads the tokenizer from the checkpoint it serves; drop --tokenizer, or "
                              "serve a checkpoint directory holding the tokenizer you want")
