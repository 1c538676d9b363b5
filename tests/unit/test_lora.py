"""LoRA adapters on tiny checkpoints: the adapter's math against its weights merged into the
base model, batches mixing adapters, slots and eviction, the scheduler's waiting rule, the
adapter checks and their errors, vLLM's flags, and adapter-aware routing (the real-model
checks against peft are in tests/real/test_lora.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from hybridlb.api.dispatch.lora import prefer_holders
from hybridlb.checkpoint.lora import AdapterError, check_adapter
from hybridlb.cli.vllm_args import translate
from hybridlb.config import EngineConfig
from hybridlb.engine.block_manager import BlockManager
from hybridlb.engine.lora import AdapterSlots
from hybridlb.engine.request import Request
from hybridlb.engine.scheduler import Scheduler
from hybridlb.llm import LLM
from hybridlb.params import LoRARequest, SamplingParams
from hybridlb.testing.adapters import merge_adapter, write_adapter

PROMPTS = [[5, 17, 99, 3, 250, 8], [44, 45, 46], [900, 12, 7, 7, 7, 31, 64, 2, 18]]
NEW_TOKENS = 12


def _greedy(llm: LLM, lora: list[LoRARequest | None]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, lora=a) for a in lora]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lora))]
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llama_adapters(checkpoints, tmp_path_factory):
    """A tiny Llama, three adapters of it (different modules, ranks, scalings) and, for each, the
    checkpoint with the adapter merged in."""
    model = checkpoints("llama")
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "attn": dict(targets=["q_proj", "v_proj"], rank=4, alpha=8),
        "all": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rank=8,
                    alpha=4, use_rslora=True),
        "mlp": dict(targets=["down_proj", "up_proj"], rank=2, alpha=16, layers=[1]),
    }
    adapters, merged = {}, {}
    for seed, (name, spec) in enumerate(specs.items()):
        path = write_adapter(root / name, model, seed=seed, **spec)
        adapters[name] = LoRARequest(name, str(path))
        merged[name] = str(merge_adapter(model, path, root / f"merged-{name}"))
    return model, adapters, merged


def test_adapters_compute_their_merged_weights_alone_and_in_one_mixed_batch(llama_adapters):
    model, adapters, merged = llama_adapters
    expected = {name: _greedy(LLM(path, dtype="float32"), [None] * 3) for name, path in merged.items()}
    expected[None] = _greedy(LLM(model, dtype="float32"), [None] * 3)
    assert len({json.dumps(v) for v in expected.values()}) == 4  # every adapter changes the output

    llm = LLM(model, dtype="float32", lora={"max_loras": 3, "max_lora_rank": 8})
    for name, lora in adapters.items():
        assert _greedy(llm, [lora] * 3) == expected[name], name
    order = [None, "attn", "all", "mlp"] * 3  # one batch: three adapters and the base model, interleaved
    outputs = _greedy(llm, [adapters.get(name) for name in order])
    for i, (name, tokens) in enumerate(zip(order, outputs, strict=True)):
        assert tokens == expected[name][i % len(PROMPTS)], (i, name)


def test_more_adapters_than_slots_wait_evict_and_stay_exact(llama_adapters):
    model, adapters, merged = llama_adapters
    expected = {name: _greedy(LLM(path, dtype="float32"), [None] * 3) for name, path in merged.items()}
    llm = LLM(model, dtype="float32", lora={"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 2})
    order = ["attn", "all", "mlp", "attn", "mlp", "all"]
    outputs = _greedy(llm, [adapters[name] for name in order])
    for i, (name, tokens) in enumerate(zip(order, outputs, strict=True)):
        assert tokens == expected[name][i % len(PROMPTS)], (i, name)
    assert llm.engine.scheduler.adapters.loads >= 3


def test_adapter_kv_blocks_are_never_shared_with_the_base_model(llama_adapters):
    model, adapters, merged = llama_adapters
    prompt = list(range(40, 40 + 48))  # three full blocks
    llm = LLM(model, dtype="float32", lora={"max_loras": 2, "max_lora_rank": 8})
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([prompt], [params])
    hits = llm.engine.blocks.hit_tokens
    adapted = llm.generate([prompt], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                     lora=adapters["attn"])])
    assert llm.engine.blocks.hit_tokens == hits  # nothing reused from the base model's blocks
    assert adapted[0].token_ids == LLM(merged["attn"], dtype="float32").generate([prompt], [params])[0].token_ids
    llm.generate([prompt], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, lora=adapters["attn"])])
    assert llm.engine.blocks.hit_tokens > hits  # ... but the same adapter reuses its own


def test_moe_models_adapt_attention_and_refuse_expert_modules(checkpoints, tmp_path):
    model = checkpoints("qwen3_moe")
    attention = write_adapter(tmp_path / "attn", model, ["q_proj", "o_proj"], seed=3)
    merged = merge_adapter(model, attention, tmp_path / "merged")
    llm = LLM(model, dtype="float32", lora={"max_loras": 1, "max_lora_rank": 8})
    assert _greedy(llm, [LoRARequest("attn", str(attention))] * 3) == _greedy(LLM(str(merged), dtype="float32"),
                                                                                [None] * 3)
    experts = write_adapter(tmp_path / "mlp", model, ["gate_proj"])
    with pytest.raises(AdapterError, match=r"layer 0's MLP is a mixture of experts; hybridlb adapts the attention"):
        check_adapter(experts, model, 16)


def test_bad_adapters_are_refused_with_the_problem_and_the_fix(checkpoints, tmp_path):
    model = checkpoints("llama")
    with pytest.raises(AdapterError, match=r"no adapter directory at .*/nowhere"):
        check_adapter(tmp_path / "nowhere", model, 16)
    good = write_adapter(tmp_path / "good", model, ["q_proj"], rank=8)
    with pytest.raises(AdapterError, match=r"has rank 8, above max_lora_rank=4; raise --max-lora-rank to at least 8"):
        check_adapter(good, model, 4)
    dora = write_adapter(tmp_path / "dora", model, ["q_proj"], use_dora=True)
    with pytest.raises(AdapterError, match=r"DoRA adapters are not supported"):
        check_adapter(dora, model, 16)
    other = write_adapter(tmp_path / "other", model, ["q_proj"])
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(128, 4)},
              other / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"model.layers.0.self_attn.q_proj has lora_A \[4, 64\] and lora_B "
                                           r"\[128, 4\], but the base model needs \[r, 128\] and \[128, r\]; this "
                                           r"adapter was trained for another base model"):
        check_adapter(other, model, 16)
    config = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(AdapterError, match=r"peft_type 'IA3' is not served; hybridlb serves LoRA adapters only"):
        check_adapter(good, model, 16)
    (good / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"has no adapter_config.json"):
        check_adapter(good, model, 16)
    head = write_adapter(tmp_path / "head", model, ["q_proj"])
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 128)}, head / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"'base_model.model.lm_head.lora_A.weight' is not a LoRA weight of a "
                                           r"decoder layer's projection"):
        check_adapter(head, model, 16)


def test_a_request_for_a_bad_or_unserved_adapter_fails_alone(checkpoints, tmp_path):
    model = checkpoints("llama")
    llm = LLM(model, dtype="float32", lora={"max_loras": 1})
    with pytest.raises(ValueError, match=r"LoRA adapter 'gone': no adapter directory"):
        llm.generate([[1, 2, 3]], [SamplingParams(lora=LoRARequest("gone", str(tmp_path / "gone")))])
    plain = LLM(model, dtype="float32")
    with pytest.raises(ValueError, match=r"serves no LoRA adapters .* needs --enable-lora"):
        plain.generate([[1, 2, 3]], [SamplingParams(lora=LoRARequest("x", str(tmp_path)))])


def _request(name: str | None, rid: str) -> Request:
    lora = LoRARequest(name, f"/adapters/{name}") if name else None
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, lora=lora), 8, None)


def test_slots_keep_held_adapters_evict_the_least_recent_idle_one_and_wait_when_all_are_busy():
    slots = AdapterSlots(2)
    a, b, c = (LoRARequest(n, f"/adapters/{n}") for n in "abc")
    assert (slots.assign(a, set()), slots.assign(b, set()), slots.assign(a, set())) == (0, 1, 0)
    assert slots.assign(c, {a}) == 1  # b: the idle one
    assert slots.names() == ["a", "c"] or slots.names() == ["c", "a"]
    assert slots.assign(b, {a, c}) is None  # every slot busy: wait
    assert slots.assign(LoRARequest("a", "/elsewhere"), {c}) == 0  # same name, new path: a reload
    assert slots.loads == 4


def test_a_request_whose_adapter_has_no_free_slot_waits_and_lets_others_pass():
    scheduler = Scheduler(8, 64, BlockManager(64, 4), adapters=AdapterSlots(1))
    first, blocked, base = _request("a", "1"), _request("b", "2"), _request(None, "3")
    for request in (first, blocked, base):
        scheduler.add(request)
    admitted = [chunk.request.request_id for chunk in scheduler.schedule()]
    assert admitted == ["1", "3"]  # "2" waits for a's slot, the base request goes ahead
    assert list(scheduler.waiting) == [blocked]
    stats = scheduler.adapter_stats()
    assert (stats["lora_running"], stats["lora_waiting"], stats["lora_loaded"]) == (["a"], ["b"], ["a"])
    scheduler.finish(first)
    assert [chunk.request.request_id for chunk in scheduler.schedule()][-1] == "2"
    assert blocked.lora_slot == 0


def _rank(name, requests, holds=(), full=False):
    return SimpleNamespace(rank=name, requests=requests, adapters=lambda: set(holds), queue_full=full)


def test_routing_prefers_ranks_holding_the_adapter_within_the_load_gap():
    idle, holder = _rank(0, 0), _rank(1, 3, holds={"a"})
    assert [r.rank for r in prefer_holders([idle, holder], "a")] == [1]
    assert [r.rank for r in prefer_holders([idle, holder], "b")] == [0]  # held nowhere: the rank with a free slot
    assert [r.rank for r in prefer_holders([_rank(0, 0, {"c"}), holder], "b")] == [0, 1]  # a tie: the policy decides
    busy_holder = _rank(1, 9, holds={"a"})  # 9 above the idle rank: the adapter spreads
    assert [r.rank for r in prefer_holders([idle, busy_holder], "a")] == [0]
    full_holder = _rank(1, 0, holds={"a"}, full=True)
    assert [r.rank for r in prefer_holders([idle, full_holder], "a")] == [0]


def test_vllm_lora_flags_and_their_errors():
    args, _ = translate(["m", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
    assert args == ["--model", "m", "--enable-lora", "--lora-modules", "a=/x", "--lora-modules", "b=/y",
                    "--max-loras", "2"]
    with pytest.raises(ValidationError, match=r"max_cpu_loras \(1\) is below max_loras \(2\)"):
        EngineConfig(model="m", lora={"max_loras": 2, "max_cpu_loras": 1})
    with pytest.raises(ValidationError, match=r"lora modules name \['a'\] twice"):
        EngineConfig(model="m", lora={"modules": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_and_the_torch_path_add_the_same_lora(dtype):
    """lora.c (each row its own adapter) against the masked torch path, on rows mixing slots,
    the base model (-1) and a part one adapter leaves alone; groups of 1 to 4 rows, ranks that
    are not a multiple of the kernel's block of 4, and widths past its 64-column blocks."""
    from hybridlb import kernels
    from hybridlb.model.lora import LoRALinear, LoRARows

    cpu = kernels.load()
    if cpu is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    generator = torch.Generator().manual_seed(0)
    parts = [("q_proj", 88), ("k_proj", 24), ("v_proj", 24)]
    rows = LoRARows()
    base = torch.nn.Linear(56, 136, bias=False).to(dtype)
    linear = LoRALinear(base, 56, parts, 3, 8, rows, dtype, torch.device("cpu"))
    for slot, rank in ((0, 8), (1, 3), (2, 5)):
        for module, width in parts:
            if slot == 1 and module == "k_proj":
                continue  # adapter 1 leaves k alone: rank 0 there
            a, b = torch.randn(rank, 56, generator=generator), torch.randn(width, rank, generator=generator)
            linear.write(slot, module, a.to(dtype), b.to(dtype), 0.5)
    x = torch.randn(12, 56, generator=generator).to(dtype)
    rows.set([2, -1, 0, 1, 1, 2, 0, -1, 1, 1, 1, 2], dtype, torch.device("cpu"))
    with torch.inference_mode():
        torch_path = linear(x)
        linear.kernels = cpu
        kernel = linear(x)
    # bfloat16: the torch path rounds A @ x to bfloat16 before B, the kernel does not: a few ulps
    # of the output's largest values apart.
    scale = torch_path.float().abs().max().item()
    tolerance = 1e-5 * scale if dtype == torch.float32 else 1e-2 * scale
    assert torch.allclose(kernel.float(), torch_path.float(), rtol=0, atol=tolerance)
    assert not torch.allclose(kernel.float(), base(x).float(), rtol=0, atol=tolerance)
    assert torch.equal(kernel[1], base(x)[1])  # a base-model row gets nothing added
