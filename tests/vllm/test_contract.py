"""What hybridlb.engine.vllm_backend takes from vLLM's internals, pinned: an upgrade of vLLM that
moves any of it fails here, by name, rather than as a crash inside a serving engine."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest

from hybridlb.config import EngineConfig
from hybridlb.engine import vllm_backend
from hybridlb.engine.vllm_backend.convert import FINISH


@pytest.fixture(autouse=True)
def _no_leaked_environment():
    """vLLM, imported or run in this process, sets a score of variables in os.environ (its threads'
    cores, LD_PRELOAD, LOCAL_WORLD_SIZE, ...); later tests' servers must not inherit them (a Ray
    actor with one CPU got a 2-core binding and vLLM's attention refused its step)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_the_engine_core_api_the_backend_drives():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    for method in ("add_request", "abort_requests", "step", "post_step", "preprocess_add_request", "add_lora"):
        assert callable(getattr(EngineCore, method)), method
    assert list(inspect.signature(EngineCore).parameters)[:3] == ["vllm_config", "executor_class", "log_stats"]
    # built positionally: request_id, prompt, mm_features, sampling, pooling, arrival, lora, cache_salt, dp rank
    assert list(EngineCoreRequest.__struct_fields__[:9]) == [
        "request_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params", "arrival_time",
        "lora_request", "cache_salt", "data_parallel_rank"]
    assert {"request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors", "finish_reason",
            "stop_reason"} <= set(EngineCoreOutput.__struct_fields__)
    assert {int(reason): str(reason) for reason in FinishReason} == {
        number: name for number, name in FINISH.items() if number != 4} | {4: "repetition"}
    assert LogprobsLists._fields[:2] == ("logprob_token_ids", "logprobs")
    assert {"logprob_token_ids", "logprobs"} <= set(LogprobsTensors._fields)
    assert callable(Scheduler.has_requests)
    assert {"prefix_cache_stats"} <= {field.name for field in dataclasses.fields(SchedulerStats)}
    assert {"queries", "hits", "preempted_requests"} <= {field.name for field in dataclasses.fields(PrefixCacheStats)}


def test_the_sampling_parameters_the_backend_sets():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sampling = SamplingParams(temperature=0, top_p=1, top_k=0, min_p=0, seed=1, repetition_penalty=1,
                              presence_penalty=0, frequency_penalty=0, stop_token_ids=[5], ignore_eos=False,
                              max_tokens=4, min_tokens=1, logprobs=2, prompt_logprobs=1, logit_bias={3: 1.0},
                              allowed_token_ids=[1, 2], detokenize=False)
    sampling.update_from_generation_config({"eos_token_id": [2, 7]}, 2)
    assert sampling.eos_token_id == 2 and set(sampling.stop_token_ids) == {5, 7}
    assert {2, 5, 7} <= sampling.all_stop_token_ids
    sampling._bad_words_token_ids = [[1, 2]]
    assert sampling.bad_words_token_ids == [[1, 2]]
    assert callable(sampling.verify)
    fields = {field.name for field in dataclasses.fields(StructuredOutputsParams)}
    assert {"json", "regex", "choice", "grammar", "structural_tag", "disable_any_whitespace",
            "disable_additional_properties"} <= fields


def test_every_engine_argument_the_backend_derives_is_one_of_vllms(smollm2_hf_dir):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineConfig(model=smollm2_hf_dir, backend="vllm", max_model_len=512, max_num_batched_tokens=256,
                          speculative={"method": "ngram", "num_speculative_tokens": 3},
                          lora={"max_loras": 2, "max_lora_rank": 8})
    args = vllm_backend.engine_args(config, smollm2_hf_dir)
    assert isinstance(args, EngineArgs)
    assert (args.max_model_len, args.max_num_batched_tokens, args.enable_lora, args.max_loras) == (512, 256, True, 2)
    assert args.kv_cache_memory_bytes == int(0.5 * 2**30)


def test_an_unknown_vllm_argument_is_named_with_the_nearest_one(smollm2_hf_dir):
    config = EngineConfig(model=smollm2_hf_dir, backend="vllm", vllm_args={"max_logprob": 5, "bogus_option": 1})
    with pytest.raises(ValueError, match=r"bogus_option, max_logprob \(did you mean max_logprobs\?\)"):
        vllm_backend.engine_args(config, smollm2_hf_dir)


def test_a_users_thread_binding_outside_the_processs_cores_stops_the_rank_before_vllm_starts(smollm2_hf_dir,
                                                                                               monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "4096-4097")
    with pytest.raises(ValueError, match=r"names cores 4096-4097 .*or unset it"):
        vllm_backend.VllmCore(EngineConfig(model=smollm2_hf_dir, backend="vllm", enforce_eager=True))


def test_another_vllm_release_is_refused_with_the_install_command(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(vllm_backend.VllmUnavailable, match=r"speaks to vLLM 0\.32\.0; this environment has 0\.99\.0"
                                                           r".*pip install -e '\.\[vllm\]'"):
        vllm_backend.require_vllm()
    monkeypatch.undo()
    assert vllm_backend.require_vllm() == "0.32.0"


def test_a_core_in_this_process_runs_a_request_and_reports_its_load(smollm2_hf_dir):
    """The scheduler's queues and KV usage (stats), outputs, logprobs and the finish, on the real model;
    no step compiles anything (the logprobs helper vLLM compiles on first use was compiled at start)."""
    from torch._dynamo.utils import counters

    from hybridlb.params import SamplingParams

    core = vllm_backend.VllmCore(EngineConfig(model=smollm2_hf_dir, backend="vllm", enforce_eager=True,
                                              max_model_len=256, dtype="float32", kv_cache_gib=0.1))
    prompt = [1, 504, 3458, 314, 260]
    assert core.add_request("a", prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=1,
                                                        prompt_logprobs=1)) is None
    assert core.add_request("a", prompt, SamplingParams()).error == "request id 'a' is already in use"
    waiting = core.stats()
    assert (waiting.num_waiting, waiting.num_running) == (1, 0)
    outputs, graphs = [], counters["stats"]["unique_graphs"]
    while core.has_work:
        outputs += core.step()
        assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a graph: a silent step of seconds"
        if outputs and outputs[-1].finish_reason is None:
            stats = core.stats()
            assert (stats.num_waiting, stats.num_running) == (0, 1) and stats.kv_usage > 0
    assert [len(o.new_token_ids) for o in outputs] == [1] * 5 and outputs[-1].finish_reason == "length"
    assert len(outputs[0].prompt_logprobs) == len(prompt) and outputs[0].prompt_logprobs[0] is None
    assert [o.logprobs[0].token_id for o in outputs] == [o.new_token_ids[0] for o in outputs]
    assert core.add_request("b", prompt, SamplingParams(max_tokens=2, temperature=0)) is None
    while core.has_work:
        core.step()
    done = core.stats()  # prompt logprobs skip the prefix cache (vLLM), so only b's prompt was looked up
    assert (done.num_running, done.kv_usage, done.steps, done.prefix_queries) == (0, 0, 7, len(prompt))


def test_the_kv_events_the_backend_follows():
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.sched.scheduler import Scheduler

    assert {"enable_kv_cache_events", "publisher"} <= {f.name for f in dataclasses.fields(KVEventsConfig)}
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name"} <= set(
        BlockStored.__struct_fields__)
    assert "block_hashes" in BlockRemoved.__struct_fields__ and AllBlocksCleared.__name__ == "AllBlocksCleared"
    assert "events" in KVEventBatch.__struct_fields__
    assert "self.kv_event_publisher.publish(" in inspect.getsource(Scheduler)  # where the backend's feed sits


def test_blocks_vllm_caches_and_evicts_come_out_under_hybridlbs_hashes(smollm2_hf_dir):
    """The API servers' prefix indexes hear of cached and evicted blocks by the hashes they route by."""
    from hybridlb.engine.block_manager import Removed
    from hybridlb.params import SamplingParams
    from hybridlb.prefix_hash import block_hashes, hash_seed

    core = vllm_backend.VllmCore(EngineConfig(model=smollm2_hf_dir, backend="vllm", enforce_eager=True,
                                              max_model_len=512, dtype="float32", kv_cache_gib=0.04))
    size, seed = core.block_size, hash_seed(smollm2_hf_dir)
    prompts = [[100 + i] * (2 * size + 5) for i in range(6)]  # two full blocks each, none shared
    for i, prompt in enumerate(prompts):
        assert core.add_request(str(i), prompt, SamplingParams(max_tokens=2, temperature=0)) is None
        while core.has_work:
            core.step()
    events = core.take_cache_events()
    removed = {event.block_hash for event in events if isinstance(event, Removed)}
    stored = {event.block_hash for event in events if not isinstance(event, Removed)}
    ours = {h for prompt in prompts for h in block_hashes(prompt, size, seed)}
    assert stored == ours  # every prompt's full blocks (the 2 tokens generated fill none)
    assert removed and removed <= ours, (len(removed), core.num_kv_blocks)
    assert not core.take_cache_events()  # handed out once
