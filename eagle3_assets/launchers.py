"""How the `hidden_states` asset launches one shard's extraction job, from the settings.

- `launcher.kind: local` (default): a subprocess on this machine through
  `PipesSubprocessClient`, under `torchrun` when `extraction.nproc > 1`.
- `launcher.kind: kubernetes`: one pod per shard through `dagster_k8s.PipesK8sClient`;
  the pod runs `torchrun` over its GPUs; rank 0 talks Pipes over the pod's logs.

The asset calls

    pipes_client_for(settings).run(context=context, **launch_spec(settings, shard, params_json))

where `params_json` is the job's `ExtractParams` as JSON (`$EAGLE3_EXTRACT_PARAMS`).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from .launcher_settings import KubernetesSettings, LauncherSettings
from .resources import launch_command

JOB_MODULE = "eagle3_assets.jobs.extract_hidden_states"
PARAMS_ENV = "EAGLE3_EXTRACT_PARAMS"
CONTAINER_NAME = "extract-hidden-states"
SHM_VOLUME = "eagle3-dshm"
SHARD_LABEL = "eagle3.dev/shard"
JOB_LABEL = "eagle3.dev/job"


def launcher_settings(settings) -> LauncherSettings:
    """The `launcher:` section; the local launcher for settings that have none."""
    return getattr(settings, "launcher", None) or LauncherSettings()


def pod_command(gpus: int) -> list[str]:
    """The GPU pod's command: one process per GPU under torchrun (plain python for one GPU)."""
    job = ["-m", JOB_MODULE]
    if gpus == 1:
        return ["python", *job]
    return ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={gpus}", *job]


def gpus_per_pod(settings) -> int:
    k8s = launcher_settings(settings).kubernetes
    return k8s.gpus_per_pod or settings.extraction.nproc


def pipes_client_for(settings):
    """`PipesSubprocessClient` for the local launcher, `PipesK8sClient` for Kubernetes."""
    launcher = launcher_settings(settings)
    if launcher.kind == "local":
        from dagster import PipesSubprocessClient

        return PipesSubprocessClient()
    try:
        from dagster_k8s import PipesK8sClient
    except ImportError as e:
        raise ImportError("launcher.kind is 'kubernetes' but dagster-k8s is not installed: pip install 'eagle3-assets[k8s]'") from e
    k8s = launcher.kubernetes
    return PipesK8sClient(
        load_incluster_config=k8s.load_incluster_config,
        kubeconfig_file=k8s.kubeconfig_file,
        kube_context=k8s.kube_context,
        poll_interval=k8s.poll_interval_s,
    )


def launch_spec(settings, shard: str, params_json: str) -> dict[str, Any]:
    """Keyword arguments of the Pipes client's `run` (besides `context`) for one shard."""
    launcher = launcher_settings(settings)
    if launcher.kind == "local":
        return {"command": launch_command(JOB_MODULE, settings.extraction.nproc), "env": {PARAMS_ENV: params_json}}
    k8s = launcher.kubernetes
    check_paths_are_shared(k8s, json.loads(params_json))
    # PipesK8sClient.run(context, extras, image, command, namespace, env, base_pod_meta, base_pod_spec,
    # ignore_containers, enable_multi_container_logs, pod_wait_timeout, delete_pod_on_completion):
    # command and env live in base_pod_spec; the client appends its Pipes bootstrap env to the first container.
    return {
        "image": k8s.image,
        "namespace": k8s.namespace,
        "base_pod_meta": build_pod_meta(settings, shard),
        "base_pod_spec": build_pod_spec(settings, shard, params_json),
        "pod_wait_timeout": k8s.pod_wait_timeout_s,
        "delete_pod_on_completion": k8s.delete_pod_on_completion,
    }


def build_pod_meta(settings, shard: str) -> dict[str, Any]:
    k8s = launcher_settings(settings).kubernetes
    return {"labels": {**k8s.labels, JOB_LABEL: "extract-hidden-states", SHARD_LABEL: shard}}


def build_pod_spec(settings, shard: str, params_json: str) -> dict[str, Any]:
    """The extraction pod's spec (Kubernetes PodSpec, camelCase) for one shard."""
    k8s: KubernetesSettings = launcher_settings(settings).kubernetes
    gpus = gpus_per_pod(settings)
    quantities = {"cpu": k8s.resources.cpu, "memory": k8s.resources.memory, k8s.gpu_resource: str(gpus)}
    env = [
        {"name": PARAMS_ENV, "value": params_json},
        {"name": "EAGLE3_SHARD", "value": shard},
        {"name": "PYTHONUNBUFFERED", "value": "1"},  # Pipes messages reach the pod log at once
    ]
    env += [{"name": k, "value": v} for k, v in sorted(k8s.env.items()) if k not in {e["name"] for e in env}]
    volumes = [dict(v) for v in k8s.volumes]
    mounts = [dict(m) for m in k8s.volume_mounts]
    if k8s.shm_size:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": pod_command(gpus),
        "env": env,
        "resources": {"limits": dict(quantities), "requests": dict(quantities)},
    }
    if mounts:
        container["volumeMounts"] = mounts
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        spec["tolerations"] = [dict(t) for t in k8s.tolerations]
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    return spec


def check_paths_are_shared(k8s: KubernetesSettings, params: dict) -> None:
    """The pod reads the generations and the model and writes the shard through a shared mount."""
    mounts = [PurePosixPath(m["mountPath"]) for m in k8s.volume_mounts if "mountPath" in m]
    for key in ("generations_path", "shard_dir", "model_dir"):
        if key not in params:
            continue
        path = PurePosixPath(params[key])
        if not any(path == m or m in path.parents for m in mounts):
            raise ValueError(
                f"{key} {path} is not under any launcher.kubernetes.volume_mounts "
                f"({', '.join(map(str, mounts)) or 'none'}): the GPU pod could not see it. Put storage_root, "
                "the target model and model_cache_dir on the shared volume, mounted at the same path in the "
                "Dagster run pods and in the GPU pods"
            )
