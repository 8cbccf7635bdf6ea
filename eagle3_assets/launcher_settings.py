"""Where the GPU jobs (hidden-state extraction) run: this machine, or one Kubernetes pod per shard.

`LauncherSettings` is the `launcher:` section of the settings file:

```yaml
launcher:
  kind: kubernetes
  kubernetes:
    image: registry.example.com/eagle3-assets:0.1.0
    namespace: eagle3
    gpus_per_pod: 8
    node_selector: {nvidia.com/gpu.product: NVIDIA-H200}
    volumes: [{name: data, persistentVolumeClaim: {claimName: eagle3-data}}]
    volume_mounts: [{name: data, mountPath: /data}]
storage_root: /data/eagle3
```

Volumes, mounts and tolerations are written as in a Kubernetes pod spec (camelCase keys);
`launchers.build_pod_spec` places them in the pod, and the tests validate the result against
the Kubernetes OpenAPI schema. The shard files cross from the Dagster run to the GPU pod
through the shared filesystem, so `storage_root` (and the target model) must lie under one
of `volume_mounts`, mounted at the same path in the Dagster run pods.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PodResources(_Strict):
    """CPU and memory of one extraction pod (requests = limits: a guaranteed pod is not evicted first)."""

    cpu: str = "32"
    memory: str = "256Gi"


class KubernetesSettings(_Strict):
    image: str = "eagle3-assets:latest"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    namespace: str | None = None  # None: the namespace the Dagster run pod is in, else "default"
    gpus_per_pod: int | None = Field(None, ge=1)  # None: extraction.nproc; one torchrun process per GPU
    gpu_resource: str = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    volumes: list[dict[str, Any]] = [{"name": "eagle3-data", "persistentVolumeClaim": {"claimName": "eagle3-data"}}]
    volume_mounts: list[dict[str, Any]] = [{"name": "eagle3-data", "mountPath": "/data"}]
    resources: PodResources = PodResources()
    shm_size: str | None = "64Gi"  # /dev/shm for torch/NCCL; None keeps the container runtime's 64 MiB
    service_account: str | None = None
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    pod_wait_timeout_s: float = Field(24 * 3600, ge=0)  # 0: wait forever
    delete_pod_on_completion: bool = True
    load_incluster_config: bool | None = None  # None: in cluster when KUBERNETES_SERVICE_HOST is set
    kubeconfig_file: str | None = None
    kube_context: str | None = None
    poll_interval_s: float = Field(10.0, gt=0)


class LauncherSettings(_Strict):
    kind: Literal["local", "kubernetes"] = "local"
    kubernetes: KubernetesSettings = KubernetesSettings()
