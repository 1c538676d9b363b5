"""``hybridlb render k8s``: the same cluster as a LeaderWorkerSet (one pod per node, no Ray).

Each pod runs ``hybridlb serve`` with the shared config (a ConfigMap mounted as a file) and
computes its start rank from the worker index LeaderWorkerSet gives it; the leader (index 0)
is the head node, reached by every pod at ``$LWS_LEADER_ADDRESS`` (a DNS name), so no node
address need be known in advance. The cluster token lives in a Secret, read from the
environment: the config's, else one drawn at render time, so that only the group's pods can
join (``--no-token-secret`` leaves the handshake open). The model comes from a volume (a
PersistentVolumeClaim or a host path, mounted where ``engine.model`` points) or is baked into
the image. Every pod gets a memory request sized from the model, a memory-backed
``/dev/shm``, a startup probe that gives a slow load its time before liveness applies, and
labels an llm-d InferencePool can select; every node that serves HTTP gets a Service of its
own, and one Service spans them all (what a plain client or an Ingress points at). Multi-port
pods are probed on the supervisor: liveness on ``/health`` (no rank left dead, the supervisor
not wedged), readiness and start-up on ``/readyz`` (a rank serves, once every rank has been up).

Pods run unprivileged (non-root, no privilege escalation, no capabilities, a read-only root
with /tmp an emptyDir, no service-account token); the API key, like the cluster token, is a
Secret, never in the ConfigMap. A NetworkPolicy (``--no-network-policy`` leaves it out) opens
the HTTP ports, admits only the scheduler's pods (llm-d's endpoint picker, whose KV-cache
indexer reads them) to the KV-event ports, which carry prompt token ids, and keeps the
cluster's own ports to the group's pods.
"""

from __future__ import annotations

import math
import posixpath
import secrets
from dataclasses import dataclass

import yaml

from hybridlb.checkpoint.hub import names_hub_model
from hybridlb.config import Config, NodeConfig
from hybridlb.plan import ClusterPlan

CONFIG_PATH = "/etc/hybridlb/config.yaml"
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
# What llm-d's InferencePools select model servers by: the key since January 2026, and the
# camel-case one its older guides use.
SERVING_LABELS = ("llm-d.ai/inference-serving", "llm-d.ai/inferenceServing")
STARTUP_PERIOD_S, STARTUP_MAX_S = 10, 1800  # a pod may load for up to 30 min before liveness applies
ENGINE_OVERHEAD_GIB = 0.75  # torch, kernels and activations of one CPU engine, beyond weights and KV
API_SERVER_GIB = 1.0
# Weights of one engine when the model is not readable where the manifest is rendered (an
# 8B model in bfloat16); `--memory-gib` sets the pod's memory instead.
UNREAD_MODEL_WEIGHTS_GIB = 16.0
MAX_POOL_PORTS = 8  # targetPorts an InferencePool (inference.networking.k8s.io/v1) may list
ENDPOINT_PICKER_PORT = 9002  # the gRPC port of llm-d's endpoint picker Service, NAME-epp
# The label the inferencepool chart (gateway-api-inference-extension, which llm-d installs) puts on
# its endpoint picker's pods: inferencepool=RELEASE-epp.
ENDPOINT_PICKER_LABEL = "inferencepool"
# The topic llm-d's KV-cache indexer keys a pod's events by: its IP, the port of the rank (filled in
# per engine), the model.
LLM_D_KV_TOPIC = "kv@${POD_IP}:{port}@{model}"
HF_CACHE_MOUNT = "/hf-cache"  # a hub ID as model: the model volume holds a Hugging Face cache, mounted here


class RenderError(ValueError):
    """The cluster cannot be expressed as a LeaderWorkerSet; the message says why."""


@dataclass(frozen=True)
class PodOptions:
    """What the config does not say about the pods: their image, where the model comes from
    (``model_pvc`` or ``model_host_path``; neither: inside the image), and their memory."""

    image: str | None = None  # default: what the Dockerfile's build commands tag, hybridlb:cpu or hybridlb:cuda
    model_pvc: str | None = None
    model_host_path: str | None = None
    memory_gib: float | None = None  # default: estimated from the model (``pod_memory_gib``)
    shm_gib: float = 1.0
    network_policy: bool = True  # a NetworkPolicy: the cluster ports open to the group's own pods only
    token_secret: bool = True  # a Secret with the cluster token: the config's, else drawn at render time
    kv_events_from: str | None = None  # KEY=VALUE: the scheduler's pods (default: the endpoint picker's label)
    inference_pool: bool = True  # multi-port: render the InferencePool (False: the picker's Helm chart makes it)


class _NoAliases(yaml.SafeDumper):
    """Plain YAML for kubectl: repeated values written out, no &anchors / *aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


def whole_cluster(config: Config) -> Config:
    """``config`` with every node listed: as given, or ``size / size_local`` equal nodes when it
    describes one node of a cluster (what a LeaderWorkerSet repeats)."""
    dp = config.data_parallel
    if dp.nodes or dp.rank is not None:
        return config
    size_local = dp.size_local or dp.size
    if dp.size % size_local:
        raise RenderError(f"data-parallel size {dp.size} is not a whole number of nodes of {size_local} ranks; "
                          "make --data-parallel-size a multiple of --data-parallel-size-local")
    nodes = [NodeConfig(size_local=size_local) for _ in range(dp.size // size_local)]
    return config.model_copy(update={"data_parallel": dp.model_copy(update={"nodes": nodes, "size_local": None})})


def serve_command(plan: ClusterPlan, size_local: int, headless: bool) -> str:
    """The shell command of every pod (worker index and leader address come from the env)."""
    flags = [
        "hybridlb serve", f"--config {CONFIG_PATH}", "--host 0.0.0.0",
        f"--data-parallel-size {plan.size}", f"--data-parallel-size-local {size_local}",
        '--data-parallel-start-rank "$START_RANK"', '--data-parallel-address "$LWS_LEADER_ADDRESS"',
        f"--data-parallel-rpc-port {plan.rpc_port}", f"--lb-mode {plan.mode}",
    ]
    if headless:
        flags.append("--headless")
    return f"START_RANK=$((LWS_WORKER_INDEX * {size_local})); exec " + " ".join(flags)


def pod_memory_gib(config: Config, size_local: int, headless: bool) -> float:
    """A pod's memory request: each engine holds the weights in its serving dtype (``auto``
    counts as float32 on CPU, where it depends on the node's CPU), plus on CPU its KV cache,
    plus a fixed overhead; an API server adds its own. Reads the model's config here, and
    assumes ``UNREAD_MODEL_WEIGHTS_GIB`` of weights when it cannot (``memory_note`` says so)."""
    engine = config.engine
    weights = _weights_gib(config)
    if weights is None:
        weights = UNREAD_MODEL_WEIGHTS_GIB
    kv = engine.kv_cache_gib if engine.device == "cpu" else 0.0
    total = size_local * (weights + kv + ENGINE_OVERHEAD_GIB) + (0 if headless else API_SERVER_GIB)
    return math.ceil(total * 4) / 4


def _weights_gib(config: Config) -> float | None:
    """One engine's weights in memory, from the checkpoint's config; None where it is not readable."""
    from hybridlb.checkpoint.spec import CheckpointError, load_spec

    engine = config.engine
    try:
        parameters = load_spec(engine.model).num_parameters
    except CheckpointError:
        return None
    wide = engine.dtype == "float32" or (engine.dtype == "auto" and engine.device == "cpu")
    return parameters * (4 if wide else 2) / 2**30


def memory_note(config: Config, options: PodOptions) -> str | None:
    """What the user should know about the pods' memory request, or None."""
    if options.memory_gib is not None or _weights_gib(config) is not None:
        return None
    return (f"{config.engine.model} is not readable here, so each engine's weights are taken as "
            f"{UNREAD_MODEL_WEIGHTS_GIB:g} GiB when sizing the pods' memory; pass --memory-gib to set it")


def _container(config: Config, plan: ClusterPlan, size_local: int, headless: bool, options: PodOptions,
               name: str) -> dict:
    cpus = size_local * config.ray.cpus_per_engine + (0 if headless else config.ray.cpus_per_api_server)
    memory = _mebibytes(options.memory_gib or pod_memory_gib(config, size_local, headless))
    resources = {"requests": {"cpu": f"{math.ceil(cpus * 1000)}m", "memory": memory}, "limits": {"memory": memory}}
    if config.engine.device == "cuda":
        resources["limits"]["nvidia.com/gpu"] = str(int(size_local * (config.ray.gpus_per_engine or 1)))
    mounts = [{"name": "config", "mountPath": posixpath.dirname(CONFIG_PATH)},
              {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "scratch", "mountPath": "/tmp"}]  # the runtime directory and the kernels' build cache
    if options.model_pvc or options.model_host_path:
        mounts.append({"name": "model", "mountPath": model_mount(config.engine.model), "readOnly": True})
    hub = names_hub_model(config.engine.model)
    container = {
        "name": "hybridlb", "image": options.image or default_image(config),
        "command": ["sh", "-c", serve_command(plan, size_local, headless)],
        "resources": resources, "volumeMounts": mounts,
        "ports": [{"containerPort": plan.rpc_port + i, "name": f"dp-{i}"} for i in range(5)],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    env = [{"name": "XDG_CACHE_HOME", "value": "/tmp/cache"}]  # the root filesystem is read-only
    if hub:  # the pod resolves the hub ID in the volume's cache, never downloading
        env += [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HF_HUB_CACHE", "value": HF_CACHE_MOUNT}]
    if config.api.api_key:
        env.append({"name": "HYBRIDLB_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": f"{name}-api-key", "key": "api_key"}}})
    if options.token_secret:
        env.append({"name": "HYBRIDLB_CLUSTER_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": f"{name}-token", "key": "token"}}})
    if _publishes_kv_events(config):  # the engines name their pod in their KV-event topic
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    container["env"] = env
    if headless:
        return container
    port = config.api.port
    if plan.mode == "multi_port":
        # llm-d's pod shape: a port per rank (what the InferencePool lists), the probes on the supervisor.
        container["ports"] += [{"containerPort": port + i, "name": f"rank{i}"} for i in range(size_local)]
        container["ports"].append({"containerPort": config.lb.supervisor_port, "name": "supervisor"})
        # Readiness: a rank serves (one rank's restart keeps the pod in the Service); start-up: every
        # rank has been up once; liveness: no rank left dead and the supervisor not wedged.
        ready = {"httpGet": {"path": "/readyz", "port": "supervisor"}, "timeoutSeconds": 5}
        container["startupProbe"] = {**ready, "periodSeconds": 1, "failureThreshold": STARTUP_MAX_S}
        container["readinessProbe"] = {**ready, "periodSeconds": 10, "failureThreshold": 3}
        container["livenessProbe"] = {"httpGet": {"path": "/health", "port": "supervisor"}, "timeoutSeconds": 5,
                                      "periodSeconds": 30, "failureThreshold": 3}
        return container
    container["ports"].append({"containerPort": port, "name": "http"})
    probe = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": STARTUP_PERIOD_S}
    container["startupProbe"] = {**probe, "failureThreshold": STARTUP_MAX_S // STARTUP_PERIOD_S}
    container["readinessProbe"] = probe
    container["livenessProbe"] = {**probe, "failureThreshold": 6}
    return container


def _mebibytes(gib: float) -> str:
    """A Kubernetes memory quantity."""
    return f"{math.ceil(gib * 1024)}Mi"


def model_mount(model: str) -> str:
    """Where the model volume goes: the checkpoint directory, a GGUF file's directory, or for a
    hub ID the Hugging Face cache's (HF_HUB_CACHE)."""
    if names_hub_model(model):
        return HF_CACHE_MOUNT
    return posixpath.dirname(model) if model.endswith(".gguf") else model


def _pod(config: Config, plan: ClusterPlan, name: str, role: str, headless: bool, options: PodOptions) -> dict:
    size_local = len(plan.nodes[0].ranks)
    labels = {"app.kubernetes.io/name": "hybridlb", "app.kubernetes.io/instance": name, "role": role}
    if not headless:
        labels.update(dict.fromkeys(SERVING_LABELS, "true"))
    volumes = [{"name": "config", "configMap": {"name": f"{name}-config"}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _mebibytes(options.shm_gib)}},
               {"name": "scratch", "emptyDir": {}}]
    if options.model_pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": options.model_pvc,
                                                                   "readOnly": True}})
    elif options.model_host_path:
        volumes.append({"name": "model", "hostPath": {"path": options.model_host_path, "type": "Directory"}})
    grace = config.api.shutdown_timeout_s  # the pod's own grace must outlast it (Kubernetes' default: 30 s)
    return {
        "metadata": {"labels": labels},
        "spec": {"containers": [_container(config, plan, size_local, headless, options, name)],
                 "volumes": volumes, **({"terminationGracePeriodSeconds": math.ceil(grace) + 10} if grace else {}),
                 # Unprivileged (the Dockerfile's user), no Kubernetes API credentials: a pod needs neither.
                 "automountServiceAccountToken": False,
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                     "seccompProfile": {"type": "RuntimeDefault"}}},
    }


def default_image(config: Config) -> str:
    """What the Dockerfile's build commands tag: hybridlb:cpu or hybridlb:cuda, -vllm with vLLM's engine."""
    return f"hybridlb:{config.engine.device}" + ("-vllm" if config.engine.backend == "vllm" else "")


def cluster_name(config: Config) -> str:
    """What every object of the manifest is named after."""
    return f"hybridlb-{config.ray.name}"


def render(config: Config, plan: ClusterPlan, options: PodOptions = PodOptions()) -> str:
    """The manifest: ConfigMap, Secrets (the cluster token, an API key), LeaderWorkerSet, one
    Service per serving node and one across them, llm-d's objects (multi-port), NetworkPolicy."""
    sizes = {len(node.ranks) for node in plan.nodes}
    if len(sizes) > 1:
        raise RenderError("a LeaderWorkerSet gives every pod the same template: put the same number of ranks "
                          f"on every node (got {sorted(sizes)})")
    worker_headless = {node.headless for node in plan.nodes[1:]}
    if len(worker_headless) > 1:
        raise RenderError("the non-head nodes must all be headless or all serve HTTP")
    if options.model_pvc and options.model_host_path:
        raise RenderError("the model comes from one volume: pass --model-pvc or --model-host-path, not both")
    if names_hub_model(config.engine.model) and not (options.model_pvc or options.model_host_path):
        raise RenderError(f"model {config.engine.model} is a hub ID and pods never download: pass --model-pvc CLAIM "
                          "or --model-host-path DIR holding a Hugging Face cache with it, or a path in the image")
    _check_adapters_on_the_model_volume(config, options)
    name = cluster_name(config)
    shared = config.model_dump(mode="json", exclude_unset=True, exclude={"ray"})
    dp = shared.setdefault("data_parallel", {})
    for per_node in ("nodes", "start_rank", "size_local", "headless", "node_address", "rank", "address",
                     "cluster_token"):
        dp.pop(per_node, None)
    shared.get("api", {}).pop("api_key", None)  # a Secret, not the ConfigMap
    if _publishes_kv_events(config) and not config.engine.kv_events.topic:
        shared["engine"]["kv_events"]["topic"] = LLM_D_KV_TOPIC
    documents = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
                  "data": {"config.yaml": yaml.safe_dump(shared, sort_keys=False)}}]
    if (token := _cluster_token(config, options)) is not None:
        documents.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-token"},
                          "type": "Opaque", "stringData": {"token": token}})
    if config.api.api_key:
        documents.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-api-key"},
                          "type": "Opaque", "stringData": {"api_key": config.api.api_key}})
    worker_is_headless = bool(worker_headless and worker_headless.pop())
    documents.append(
        {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": name},
         "spec": {"replicas": 1, "leaderWorkerTemplate": {
             "size": len(plan.nodes), "restartPolicy": "RecreateGroupOnPodRestart",
             "leaderTemplate": _pod(config, plan, name, "leader", plan.nodes[0].headless, options),
             "workerTemplate": _pod(config, plan, name, "worker", worker_is_headless, options)}}})
    http = [{"name": name_, "port": port, "targetPort": port} for name_, port in serving_ports(config, plan)]
    for node in plan.nodes:
        if node.headless:
            continue
        documents.append({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-node-{node.index}"},
            "spec": {"selector": {LWS_NAME_LABEL: name, LWS_INDEX_LABEL: str(node.index)}, "ports": http},
        })
    documents.append({  # every serving pod of the group: one address for clients, an Ingress or a gateway
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
        "spec": {"selector": {LWS_NAME_LABEL: name, SERVING_LABELS[0]: "true"}, "ports": http},
    })
    if plan.mode == "multi_port":
        documents += _llm_d_objects(config, plan, name, options.inference_pool)
    if options.network_policy:
        documents.append(_network_policy(config, plan, name, options))
    return yaml.dump_all(documents, Dumper=_NoAliases, sort_keys=False)


def _check_adapters_on_the_model_volume(config: Config, options: PodOptions) -> None:
    """LoRA adapters (engine.lora.modules) are read from the model volume: each must lie under its mount."""
    lora = config.engine.lora
    if lora is None or not (options.model_pvc or options.model_host_path):
        return
    mount = model_mount(config.engine.model).rstrip("/") + "/"
    outside = [m.name for m in lora.modules if not posixpath.normpath(m.path).startswith(mount)]
    if outside:
        raise RenderError(f"LoRA adapters {', '.join(outside)} lie outside the model volume, which pods mount at "
                          f"{mount}; put them under it (e.g. {mount}adapters/NAME) so the engines can read them")


def _cluster_token(config: Config, options: PodOptions) -> str | None:
    """What the pods' token Secret holds: the config's token, else one drawn now (every pod of the
    group reads the same Secret); None without the Secret."""
    configured = config.data_parallel.cluster_token
    if options.token_secret:
        return configured or secrets.token_urlsafe(32)
    if configured:
        raise RenderError("data_parallel.cluster_token is set, and the pods read it from a Secret: drop it from "
                          "the config to render without one (--no-token-secret)")
    return None


def _network_policy(config: Config, plan: ClusterPlan, name: str, options: PodOptions) -> dict:
    """Ingress to the group's pods: the HTTP ports (and the supervisor's) from anywhere, the
    KV-event ports (prompt token ids) from the scheduler's pods only, every other port
    (handshake, coordinator, engines, rendezvous) from the group's own pods only."""
    open_ports = [{"protocol": "TCP", "port": port} for _, port in serving_ports(config, plan)]
    if plan.mode == "multi_port":
        open_ports.append({"protocol": "TCP", "port": config.lb.supervisor_port})
    group = {"podSelector": {"matchLabels": {LWS_NAME_LABEL: name}}}
    ingress = [{"from": [group]}, {"ports": open_ports}]
    endpoint = (config.engine.kv_events.endpoint or "") if _publishes_kv_events(config) else ""
    if endpoint.startswith("tcp://*:"):  # KV events for llm-d's indexer, outside the group: rank r on port + r
        first = int(endpoint.rsplit(":", 1)[1])
        scheduler = {"podSelector": {"matchLabels": _scheduler_labels(options, name)}}
        ingress.append({"from": [scheduler], "ports": [{"protocol": "TCP", "port": first,
                                                        "endPort": first + plan.size - 1}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name},
            "spec": {"podSelector": {"matchLabels": {LWS_NAME_LABEL: name}}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def _scheduler_labels(options: PodOptions, name: str) -> dict[str, str]:
    """The label of the pods that may read KV events: ``--kv-events-from``, else the one the
    inferencepool chart gives the endpoint picker the InferencePool names (NAME-epp)."""
    if options.kv_events_from is None:
        return {ENDPOINT_PICKER_LABEL: f"{name}-epp"}
    key, sep, value = options.kv_events_from.partition("=")
    if not (sep and key and value):
        raise RenderError(f"--kv-events-from {options.kv_events_from!r}: give the scheduler's pod label as KEY=VALUE")
    return {key: value}


def _publishes_kv_events(config: Config) -> bool:
    return config.engine.kv_events is not None and config.engine.kv_events.enabled


def serving_ports(config: Config, plan: ClusterPlan) -> list[tuple[str, int]]:
    """(name, port) of what a serving pod answers HTTP on: one port, or one per rank (multi-port)."""
    port = config.api.port
    if plan.mode == "multi_port":
        return [(f"rank{i}", port + i) for i in range(len(plan.nodes[0].ranks))]
    return [("http", port)]


def _llm_d_objects(config: Config, plan: ClusterPlan, name: str, inference_pool: bool) -> list[dict]:
    """Multi-port, llm-d's shape: an InferencePool whose target ports are every rank's (so the
    endpoint picker scores each rank; left out when the picker's chart makes it), and a
    PodMonitor scraping /metrics on every rank port."""
    ports = serving_ports(config, plan)
    if len(ports) > MAX_POOL_PORTS:
        raise RenderError(f"an InferencePool lists at most {MAX_POOL_PORTS} target ports, and a pod here serves "
                          f"{len(ports)} ranks; put at most {MAX_POOL_PORTS} ranks on a node")
    selector = {LWS_NAME_LABEL: name, SERVING_LABELS[0]: "true"}
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": port} for _, port in ports],
                     "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": ENDPOINT_PICKER_PORT}}}}
    return [pool] * inference_pool + [
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": name},
         "spec": {"selector": {"matchLabels": selector},
                  "podMetricsEndpoints": [{"port": port_name, "path": "/metrics", "interval": "15s"}
                                          for port_name, _ in ports]}},
    ]
