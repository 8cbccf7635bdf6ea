"""Where the GPU jobs run: one Dagster resource, `launcher`, that the GPU assets take.

Every GPU job (generation and hidden-state extraction per shard, drafter training, its
evaluation) is a `GpuJob`: a Pipes entry module, its parameters (a config dataclass, sent as
JSON in $EAGLE3_JOB_PARAMS) and a process count. A `Launcher` (a `ConfigurableResource`) runs it through a Dagster Pipes client
and returns the client's invocation, whose materialization the asset returns:

- `LocalLauncher` (`launcher.kind: local`, the default): a subprocess on this machine
  (`PipesSubprocessClient`), under `torchrun` with one process per GPU when `nproc` > 1, in a
  session of its own: it stops (state saved) when this process is told to, and dies with it;
- `KubernetesLauncher` (`launcher.kind: kubernetes`): one pod per job (`dagster_k8s.PipesK8sClient`)
  that runs `torchrun` over its GPUs; rank 0 talks Pipes over the pod's logs.

Both build their command with `job_command`. `LauncherSettings` is the `launcher:` section of the
settings file:

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
`KubernetesLauncher.pod_spec` places them in the pod, and the tests validate the result against
the Kubernetes OpenAPI schema. The shard files cross from the Dagster run to the GPU pod
through the shared filesystem, so `storage_root` (and the target model) must lie under one
of `volume_mounts`, mounted at the same path in the Dagster run pods.

`launcher_from_settings` picks one; `definitions.py` hands it to the assets, and a test or a
deployment swaps it by passing another `launcher` resource.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import PurePosixPath
from typing import Any, Literal

from dagster import Config, ConfigurableResource
from pydantic import ConfigDict, Field

from .entrypoints import PARAMS_ENV

SHM_VOLUME = "eagle3-dshm"
JOB_LABEL = "eagle3.dev/job"


@dataclasses.dataclass(frozen=True)
class GpuJob:
    name: str  # "generate-answers", "extract-hidden-states", ...: the container's name and the job label
    module: str  # the Pipes entry point, run as `python -m module`
    params: Any  # a core dataclass (GenerateJob, ExtractShards, TrainJob, EvalJob), as JSON in $EAGLE3_JOB_PARAMS
    nproc: int = 1  # processes, one per GPU; torchrun when > 1
    # GPUs of a one-process job (generation: vLLM spreads a tensor-parallel target itself; eval):
    # the pod gets these and runs one process. None: one process per GPU of the pod.
    gpus: int | None = None
    labels: dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. {"eagle3.dev/shard": key}

    @property
    def params_json(self) -> str:
        return json.dumps(dataclasses.asdict(self.params))


# The `launcher:` section of the settings file (strict: a typo in a key fails loudly).
class _Strict(Config):
    """Dagster config (the resource's fields), strict: a typo in a key fails loudly."""

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


def job_command(module: str, nproc: int, python: list[str], torchrun: list[str]) -> list[str]:
    """`python -m module`, or one process per GPU of this node under torchrun."""
    entry = ["-m", module]
    if nproc == 1:
        return [*python, *entry]
    return [*torchrun, "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", *entry]


class Launcher(ConfigurableResource):
    """Runs a GPU job through Dagster Pipes; the job's rank 0 reports the materialization."""

    def run(self, context, job: GpuJob):
        """Launch `job` for the asset being materialized in `context`; returns the Pipes invocation."""
        raise NotImplementedError


class LocalLauncher(Launcher):
    """A subprocess of the Dagster run: `python -m module`, or `torchrun` for several processes."""

    # added to the job's environment (tests: delays, thread counts). Not `env`: Dagster reads a
    # config entry {"env": ...} as an environment-variable reference.
    job_env: dict[str, str] = {}

    def __init__(self, env: dict[str, str] | None = None, **kwargs):
        super().__init__(**{"job_env": dict(env or {}), **kwargs})

    @staticmethod
    def command(job: GpuJob) -> list[str]:
        # This interpreter's torch: the job runs in the Dagster run's environment.
        return job_command(job.module, job.nproc, [sys.executable], [sys.executable, "-m", "torch.distributed.run"])

    def run(self, context, job: GpuJob):
        return _job_client().run(context=context, command=self.command(job), env={**self.job_env, PARAMS_ENV: job.params_json})


def _job_client():
    """`PipesSubprocessClient` whose job process lives in its own session, gets SIGTERM from the
    kernel if this process dies (`stopping.parent_death_signal`), and is asked to stop (SIGTERM:
    save and exit) when this process is (`stopping.forwarding`). A job that ends after such a
    request fails its step with `Failure(allow_retries=False)`: a stop on purpose is not retried."""
    import os
    import subprocess

    from dagster import Failure, PipesClientCompletedInvocation, PipesSubprocessClient, open_pipes_session

    from .core import stopping
    from .dagster_compat import PipesExecutionError

    class JobClient(PipesSubprocessClient):
        def run(self, *, context, command, env=None, extras=None, cwd=None):
            with open_pipes_session(context=context, context_injector=self.context_injector,
                                    message_reader=self.message_reader, extras=extras) as session:
                process = subprocess.Popen(
                    command, cwd=cwd, env={**os.environ, **(env or {}), **session.get_bootstrap_env_vars()},
                    start_new_session=True, preexec_fn=stopping.parent_death_signal(parent=os.getpid()))
                with stopping.forwarding(process.pid):
                    process.wait()
            # The session is closed: every message the job sent before it ended has been read.
            signal_name, code = stopping.requested(), process.returncode
            error = None
            if signal_name and code != 0:
                error = Failure(f"stopped by {signal_name}: the job saved what it had done and exited "
                                f"(code {code}); `eagle3 run` continues from there", allow_retries=False)
            elif code != 0:
                error = PipesExecutionError(f"External execution process failed with code {code}")
            if error is not None:
                # What a multi-shard job reported before it died (its finished shards) is kept.
                error.custom_messages = list(session.get_custom_messages())
                raise error
            return PipesClientCompletedInvocation(session)

    return JobClient()


class KubernetesLauncher(Launcher):
    """One pod per job on the cluster, from the `launcher.kubernetes` settings."""

    settings: KubernetesSettings = KubernetesSettings()

    def __init__(self, settings: KubernetesSettings | None = None, **kwargs):
        super().__init__(settings=settings or KubernetesSettings(), **kwargs)

    def client(self):
        try:
            from dagster_k8s import PipesK8sClient
        except ImportError as e:
            raise ImportError(
                "launcher.kind is 'kubernetes' but dagster-k8s is not installed: pip install 'eagle3-assets[k8s]'"
            ) from e
        k8s = self.settings
        return PipesK8sClient(
            load_incluster_config=k8s.load_incluster_config,
            kubeconfig_file=k8s.kubeconfig_file,
            kube_context=k8s.kube_context,
            poll_interval=k8s.poll_interval_s,
        )

    def run(self, context, job: GpuJob):
        return self.client().run(context=context, **self.launch_spec(job))

    def gpus(self, job: GpuJob) -> int:
        if job.gpus is not None:  # a one-process job: `gpus_per_pod` would leave GPUs idle
            return job.gpus
        return self.settings.gpus_per_pod or job.nproc

    def processes(self, job: GpuJob) -> int:
        return job.nproc if job.gpus is not None else self.gpus(job)

    def launch_spec(self, job: GpuJob) -> dict[str, Any]:
        """Keyword arguments of `PipesK8sClient.run` (besides `context`) for one job."""
        k8s = self.settings
        check_paths_are_shared(k8s, dataclasses.asdict(job.params))
        # PipesK8sClient.run(context, extras, image, command, namespace, env, base_pod_meta, base_pod_spec,
        # ignore_containers, enable_multi_container_logs, pod_wait_timeout, delete_pod_on_completion):
        # command and env live in base_pod_spec; the client appends its Pipes bootstrap env to the first container.
        return {
            "image": k8s.image,
            "namespace": k8s.namespace,
            "base_pod_meta": self.pod_meta(job),
            "base_pod_spec": self.pod_spec(job),
            "pod_wait_timeout": k8s.pod_wait_timeout_s,
            "delete_pod_on_completion": k8s.delete_pod_on_completion,
        }

    def pod_meta(self, job: GpuJob) -> dict[str, Any]:
        return {"labels": {**self.settings.labels, JOB_LABEL: job.name, **job.labels}}

    def pod_command(self, job: GpuJob) -> list[str]:
        """One process per GPU under torchrun (plain python for one GPU), the image's own."""
        return job_command(job.module, self.processes(job), ["python"], ["torchrun"])

    def pod_spec(self, job: GpuJob) -> dict[str, Any]:
        """The job's pod spec (Kubernetes PodSpec, camelCase)."""
        k8s = self.settings
        quantities = {"cpu": k8s.resources.cpu, "memory": k8s.resources.memory, k8s.gpu_resource: str(self.gpus(job))}
        env = [
            {"name": PARAMS_ENV, "value": job.params_json},
            {"name": "PYTHONUNBUFFERED", "value": "1"},  # Pipes messages reach the pod log at once
        ]
        env += [{"name": k, "value": v} for k, v in sorted(k8s.env.items()) if k not in {e["name"] for e in env}]
        volumes = [dict(v) for v in k8s.volumes]
        mounts = [dict(m) for m in k8s.volume_mounts]
        if k8s.shm_size:
            volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}})
            mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
        container: dict[str, Any] = {
            "name": job.name,
            "image": k8s.image,
            "imagePullPolicy": k8s.image_pull_policy,
            "command": self.pod_command(job),
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
    """The pod reads its inputs and writes its outputs through a shared mount: every path the job
    names (a `*_path`, `*_dir` or `*_dirs` parameter) must lie under one of the volume mounts."""
    mounts = [PurePosixPath(m["mountPath"]) for m in k8s.volume_mounts if "mountPath" in m]
    for key, value in params.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for nested in value:  # several shards' jobs (ExtractShards.jobs)
                check_paths_are_shared(k8s, nested)
            continue
        if not key.endswith(("_path", "_dir", "_dirs")) or value is None:
            continue
        for path in map(PurePosixPath, value if isinstance(value, list) else [value]):
            if not any(path == m or m in path.parents for m in mounts):
                raise ValueError(
                    f"{key} {path} is not under any launcher.kubernetes.volume_mounts "
                    f"({', '.join(map(str, mounts)) or 'none'}): the GPU pod could not see it. Put storage_root, "
                    "the target model and model_cache_dir on the shared volume, mounted at the same path in the "
                    "Dagster run pods and in the GPU pods"
                )


def launcher_from_settings(launcher: LauncherSettings) -> Launcher:
    if launcher.kind == "kubernetes":
        return KubernetesLauncher(launcher.kubernetes)
    return LocalLauncher()
