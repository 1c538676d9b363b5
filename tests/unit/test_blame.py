"""A step that raises because of one request fails that request alone: the engine finds it
(hybridlb.engine.blame), its batch-mates keep their tokens, and however often such requests
come, the engine never counts as sick. A fault of the engine's own still makes it sick."""

from __future__ import annotations

import pytest

from hybridlb.config import EngineConfig
from hybridlb.engine.core import SickEngine, make_core
from hybridlb.params import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _core(model: str):
    config = EngineConfig(model=model, max_model_len=256, num_kv_blocks=64, simulate={"step_ms": 0.1},
                          max_failed_steps=3)
    return make_core(config)


def _poisoned(core, poison: set[str]):
    """The runner raises for any batch holding a request in ``poison`` (as an out-of-range id
    indexing the logits did); every other batch runs."""
    run = core.runner.run

    def runs(chunks):
        if any(chunk.request.request_id in poison for chunk in chunks):
            raise IndexError("index 1000000000 is out of bounds for dimension 0 with size 1024")
        return run(chunks)

    core.runner.run = runs


def test_a_poison_request_fails_alone_and_its_batch_mates_keep_their_tokens(tiny_qwen3):
    core = _core(tiny_qwen3)
    _poisoned(core, {"poison"})
    for i in range(7):
        core.add_request(f"victim{i}", [1, 2, 3 + i], SHORT)
    core.add_request("poison", [1, 2, 3], LONG)
    outputs = core.step()
    poison = [o for o in outputs if o.request_id == "poison"]
    assert [(o.finish_reason, o.error_kind) for o in poison] == [("error", "invalid")]
    assert "IndexError" in poison[0].error and "failed alone" in poison[0].error
    tokens = {o.request_id: o.new_token_ids for o in outputs if o.request_id != "poison"}
    assert tokens == {f"victim{i}": [1] for i in range(7)}  # the simulated model echoes the prompt
    while core.has_work:
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens == {f"victim{i}": [1, 2, 3 + i] for i in range(7)}
    assert core.blocks.usage == 0.0 and core.stats().step_failures == 1


def test_poison_requests_one_after_another_never_make_the_engine_sick(tiny_qwen3):
    """Alone in their steps, as a client sending them one by one to an idle engine gets them:
    the engine's own canary step still runs, so the failures are the requests'."""
    core = _core(tiny_qwen3)
    poison = {f"poison{i}" for i in range(10)}
    _poisoned(core, poison)
    for request_id in sorted(poison):
        core.add_request(request_id, [1, 2, 3], LONG)
        assert [(o.finish_reason, o.error_kind) for o in core.step()] == [("error", "invalid")]
    core.add_request("after", [4, 5, 6], SHORT)
    assert [t for _ in range(3) for o in core.step() for t in o.new_token_ids] == [4, 5, 6]
    assert core.failed_in_a_row == 0


def test_a_fault_of_the_engine_itself_still_makes_it_sick(tiny_qwen3):
    """Every step fails, the canary's too: the engine's fault, three in a row are a sick engine."""
    core = _core(tiny_qwen3)
    core.runner.run = lambda chunks: 1 / 0
    for i in range(2):
        core.add_request(f"r{i}", [1, 2, 3], LONG)
        assert [(o.finish_reason, o.error_kind) for o in core.step()] == [("error", "internal")]
    core.add_request("last", [1, 2, 3], LONG)
    with pytest.raises(SickEngine):
        core.step()


def test_out_of_vocabulary_ids_in_any_field_are_refused_before_a_step(tiny_qwen3):
    core = _core(tiny_qwen3)
    vocab = core.vocab_size
    for field, value in [("stop_token_ids", [vocab]), ("logit_bias", {vocab + 5: 1.0}),
                         ("allowed_token_ids", [10**9]), ("bad_words", [[1, vocab]])]:
        params = SamplingParams(max_tokens=4, min_tokens=1, **{field: value})
        error = core.add_request(f"bad-{field}", [1, 2, 3], params)
        assert error is not None and error.finish_reason == "error" and error.error_kind == "invalid", field
        assert field in error.error
    assert not core.has_work


def test_a_lora_adapter_that_cannot_be_read_fails_its_request_not_the_engine(tiny_qwen3):
    """Whatever reading the adapter raises (a file truncated after it was registered)."""
    from hybridlb.params import LoRARequest

    core = _core(tiny_qwen3)
    core.config = core.config.model_copy(update={"lora": {"max_loras": 1}})

    def unreadable(lora):
        raise OSError("safetensors header is truncated")

    core.runner.check_lora = unreadable
    error = core.add_request("a", [1, 2, 3], SamplingParams(lora=LoRARequest("broken", "/nowhere")))
    assert error is not None and error.error_kind == "invalid" and "truncated" in error.error
    assert "a" not in core.requests and not core.has_work


def test_a_step_that_fails_after_its_tokens_are_taken_in_is_not_run_again(tiny_qwen3):
    """Its requests' state has moved on: a re-run would skip or repeat tokens. The engine's fault."""
    core = _core(tiny_qwen3)
    runs = []
    run = core.runner.run
    core.runner.run = lambda chunks: runs.append(len(chunks)) or run(chunks)
    for i in range(4):
        core.add_request(f"r{i}", [1, 2, 3], LONG)

    def broken(request):
        raise RuntimeError("the block table broke")

    core.blocks.cache_computed = broken
    outputs = core.step()
    assert runs == [4]  # no canary, no halves
    assert {(o.finish_reason, o.error_kind) for o in outputs} == {("error", "internal")} and len(outputs) == 4
    assert core.failed_in_a_row == 1 and not core.requests
