"""The launchers of the GPU jobs (generation, extraction, training, eval), and the infra files that go with them.

No cluster here: the pod the launcher builds is passed through dagster-k8s's own
`build_pod_body` (what `PipesK8sClient.run` sends to the API server) and validated against the
Kubernetes OpenAPI schema with `kubernetes-validate` (strict: unknown keys are errors). The
Helm values are checked for what they claim against the key names of the official chart.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest
import yaml
from dagster_k8s import PipesK8sClient
from dagster_k8s.pipes import build_pod_body
from pydantic import ValidationError

from eagle3_assets import launchers
from eagle3_assets.core.config import from_json
from eagle3_assets.core.engines import GenerateJob, GenerateShards
from eagle3_assets.core.evaluate import EvalConfig, EvalJob
from eagle3_assets.core.extract_job import ExtractConfig, ExtractJob, ExtractShards
from eagle3_assets.core.generate import GenerationConfig
from eagle3_assets.core.train import TrainConfig, TrainJob
from eagle3_assets.launchers import KubernetesSettings, LauncherSettings
from eagle3_assets.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33.0"
SHARD = "rows_00000-02000"
SHARD2 = "rows_02000-04000"


def k8s_launcher(**kubernetes_section) -> launchers.KubernetesLauncher:
    return launchers.KubernetesLauncher(KubernetesSettings(**kubernetes_section))


def extract(root: str = "/data", nproc: int = 8) -> launchers.GpuJob:
    job = ExtractJob(
        generations_path=f"{root}/eagle3/generations/{SHARD}.parquet",
        shard_dir=f"{root}/eagle3/hidden_states/{SHARD}",
        model_dir=f"{root}/models/Llama-3.1-8B-Instruct",
        target_name=f"{root}/models/Llama-3.1-8B-Instruct",
        config=ExtractConfig(nproc=nproc),
    )
    return launchers.GpuJob("extract-hidden-states", "eagle3_assets.entrypoints.extract_hidden_states", job, nproc=nproc,
                            labels={"eagle3.dev/shard": SHARD})


def train(root: str = "/data", nproc: int = 8) -> launchers.GpuJob:
    job = TrainJob(shard_dirs=[f"{root}/eagle3/hidden_states/{SHARD}"], target_model_dir=f"{root}/models/m",
                   vocab_map_path=f"{root}/eagle3/vocab_map/vocab_map.safetensors", out_dir=f"{root}/eagle3/drafter",
                   aux_layer_ids=[2, 16, 29], draft_vocab_size=32000, config=TrainConfig(nproc=nproc),
                   state_path=f"{root}/eagle3/drafter_state/train_state.pt")
    return launchers.GpuJob("train-drafter", "eagle3_assets.entrypoints.train_drafter", job, nproc=nproc)


def generate(root: str = "/data", tensor_parallel_size: int | None = None) -> launchers.GpuJob:
    """As the `generations` asset builds it for a range of two shards: one process, on the GPUs vLLM
    spreads the target over, labelled with the range."""
    config = GenerationConfig(engine="vllm", tensor_parallel_size=tensor_parallel_size) if tensor_parallel_size \
        else GenerationConfig()
    jobs = [GenerateJob(prompts_path=f"{root}/eagle3/prompts/prompts.parquet", row_start=start, row_end=start + 2000,
                        out_path=f"{root}/eagle3/generations/{shard}.parquet", model_dir=f"{root}/models/m",
                        config=config, max_prompt_tokens=2048)
            for start, shard in ((0, SHARD), (2000, SHARD2))]
    return launchers.GpuJob("generate-answers", "eagle3_assets.entrypoints.generate_answers", GenerateShards(jobs),
                            gpus=tensor_parallel_size or 1, labels={"eagle3.dev/shard": f"{SHARD}..{SHARD2}"})


def evaluate(root: str = "/data") -> launchers.GpuJob:
    job = EvalJob(f"{root}/models/m", f"{root}/eagle3/drafter", EvalConfig(num_prompts=8),
                  result_path=f"{root}/eagle3/drafter_eval/eval.json")
    return launchers.GpuJob("evaluate-drafter", "eagle3_assets.entrypoints.evaluate_drafter", job, gpus=1)


STAGES = [generate, extract, train, evaluate]
STAGE_IDS = ["generation", "extraction", "training", "eval"]


def pod_as_sent(spec_kwargs: dict) -> dict:
    """The pod `PipesK8sClient.run` creates from these kwargs (Pipes bootstrap env included), as JSON."""
    pod = build_pod_body(
        pod_name="dagster-0123456789abcdef01-hidden-states-0123456789",
        image=spec_kwargs["image"],
        command=None,
        env_vars={"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msgs"},
        base_pod_meta=spec_kwargs["base_pod_meta"],
        base_pod_spec=spec_kwargs["base_pod_spec"],
    )
    return kubernetes.client.ApiClient().sanitize_for_serialization(pod) | {"apiVersion": "v1", "kind": "Pod"}


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_local_launcher_is_the_default_and_runs_torchrun_for_several_processes():
    assert isinstance(launchers.launcher_from_settings(Settings().launcher), launchers.LocalLauncher)
    job = extract(nproc=2)
    assert launchers.LocalLauncher.command(job)[-5:] == [
        "--standalone", "--nnodes=1", "--nproc-per-node=2", "-m", "eagle3_assets.entrypoints.extract_hidden_states"]
    assert launchers.LocalLauncher.command(train(nproc=1))[1:] == ["-m", "eagle3_assets.entrypoints.train_drafter"]
    # the parameters round-trip through JSON into the job's own config classes
    assert from_json(ExtractJob, job.params_json) == job.params
    assert from_json(TrainJob, train().params_json) == train().params
    # one-process jobs stay one process locally whatever their GPUs
    assert launchers.LocalLauncher.command(generate(tensor_parallel_size=4))[1:] == [
        "-m", "eagle3_assets.entrypoints.generate_answers"]


@pytest.mark.parametrize("make_job", STAGES, ids=STAGE_IDS)
def test_every_stage_names_an_entry_module_that_exists_and_takes_its_params(make_job):
    job = make_job()
    spec = importlib.util.find_spec(job.module)
    assert spec is not None and spec.origin.endswith(job.module.rsplit(".", 1)[1] + ".py")
    assert from_json(type(job.params), job.params_json) == job.params


def test_kubernetes_launcher_is_chosen_from_the_settings():
    s = Settings(launcher={"kind": "kubernetes", "kubernetes": {"poll_interval_s": 3.0, "kube_context": "gpu-cluster"}})
    launcher = launchers.launcher_from_settings(s.launcher)
    assert isinstance(launcher, launchers.KubernetesLauncher)
    client = launcher.client()
    assert isinstance(client, PipesK8sClient)
    assert client.poll_interval == 3.0 and client.kube_context == "gpu-cluster"
    for job in (make() for make in STAGES):
        spec = launcher.launch_spec(job)
        # every key is a parameter of the installed PipesK8sClient.run
        inspect.signature(PipesK8sClient.run).bind(client, context=None, **spec)
        assert spec["image"] == "eagle3-assets:latest" and spec["pod_wait_timeout"] == 24 * 3600


@pytest.mark.parametrize("make_job", STAGES, ids=STAGE_IDS)
def test_pod_spec_validates_against_the_kubernetes_schema(make_job):
    launcher = k8s_launcher(
        image="registry.example.com/eagle3-assets:0.1.0",
        namespace="eagle3",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        service_account="eagle3-runs",
        env={"HF_HUB_OFFLINE": "1"},
        resources={"cpu": "96", "memory": "1024Gi"},
    )
    job = make_job()
    pod = pod_as_sent(launcher.launch_spec(job))
    validate(pod)
    c = pod["spec"]["containers"][0]
    assert c["name"] == job.name
    # extraction and training: torchrun over the node's GPUs; generation and eval: one process on the GPUs they name
    gpus = "8" if job.gpus is None else "1"
    if job.gpus is None:
        assert c["command"] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=8", "-m", job.module]
    else:
        assert c["command"] == ["python", "-m", job.module]
    env = [e["name"] for e in c["env"]]
    assert len(env) == len(set(env))  # the client appends its Pipes env; nothing is set twice
    assert {"EAGLE3_JOB_PARAMS", "DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES", "HF_HUB_OFFLINE"} <= set(env)
    sent = next(e["value"] for e in c["env"] if e["name"] == "EAGLE3_JOB_PARAMS")
    assert from_json(type(job.params), sent) == job.params
    assert c["resources"]["limits"] == {"cpu": "96", "memory": "1024Gi", "nvidia.com/gpu": gpus}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["spec"]["serviceAccountName"] == "eagle3-runs"
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data", "/dev/shm"}
    assert {v["name"] for v in pod["spec"]["volumes"]} == {m["name"] for m in c["volumeMounts"]}
    assert pod["metadata"]["labels"]["eagle3.dev/job"] == job.name
    assert pod["metadata"]["labels"].get("eagle3.dev/shard") == job.labels.get("eagle3.dev/shard")


def test_one_gpu_pod_runs_python_and_gpu_count_follows_the_settings():
    launcher = k8s_launcher(gpus_per_pod=1, shm_size=None, volumes=[], volume_mounts=[{"name": "x", "mountPath": "/data"}])
    spec = launcher.pod_spec(extract())
    c = spec["containers"][0]
    assert c["command"] == ["python", "-m", "eagle3_assets.entrypoints.extract_hidden_states"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and "volumes" not in spec


def test_one_process_jobs_get_their_own_gpu_count_not_the_pods():
    """`gpus_per_pod` is the torchrun jobs' width; generation and eval run one process (vLLM
    spreads a tensor-parallel target over its GPUs itself), so their pods ask for what they use."""
    launcher = k8s_launcher(gpus_per_pod=8)
    for job, gpus in ((generate(), "1"), (generate(tensor_parallel_size=4), "4"), (evaluate(), "1")):
        pod = pod_as_sent(launcher.launch_spec(job))
        validate(pod)
        c = pod["spec"]["containers"][0]
        assert c["command"] == ["python", "-m", job.module]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_the_validator_is_a_real_one():
    """A pod with a snake_case key or a wrong type is refused: the schema check is not vacuous."""
    good = pod_as_sent(k8s_launcher().launch_spec(extract()))
    validate(good)
    bad = json.loads(json.dumps(good))
    bad["spec"]["containers"][0]["volume_mounts"] = bad["spec"]["containers"][0].pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    bad = json.loads(json.dumps(good))
    bad["spec"]["tolerations"] = {"key": "nvidia.com/gpu"}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_paths_off_the_shared_volume_are_refused():
    with pytest.raises(ValueError, match="shard_dir /scratch/eagle3/hidden_states"):
        job = extract()
        k8s_launcher().launch_spec(dataclasses.replace(job, params=dataclasses.replace(
            job.params, shard_dir=f"/scratch/eagle3/hidden_states/{SHARD}")))
    with pytest.raises(ValueError, match="shard_dirs /scratch/x"):
        job = train()
        k8s_launcher().launch_spec(dataclasses.replace(job, params=dataclasses.replace(job.params, shard_dirs=["/scratch/x"])))
    # Several shards through one model load: every shard's paths are checked.
    with pytest.raises(ValueError, match="out_path /scratch/g.parquet"):
        job = generate()
        first, second = job.params.jobs
        off = GenerateShards([first, dataclasses.replace(second, out_path="/scratch/g.parquet")])
        k8s_launcher().launch_spec(dataclasses.replace(job, params=off))
    with pytest.raises(ValueError, match="result_path /tmp/eval.json"):
        job = evaluate()
        k8s_launcher().launch_spec(dataclasses.replace(job, params=dataclasses.replace(job.params, result_path="/tmp/eval.json")))
    job = extract()
    off = dataclasses.replace(job.params, shard_dir="/scratch/eagle3/hidden_states/rows_02000-04000")
    with pytest.raises(ValueError, match="shard_dir /scratch/eagle3/hidden_states/rows_02000-04000"):
        k8s_launcher().launch_spec(dataclasses.replace(job, params=ExtractShards([job.params, off])))


def test_launcher_settings_are_strict():
    with pytest.raises(ValidationError):
        LauncherSettings(kind="slurm")
    with pytest.raises(ValidationError):
        KubernetesSettings(gpus=8)  # the key is gpus_per_pod
    assert LauncherSettings().kind == "local"


def test_pod_template_is_what_the_launcher_builds():
    doc = yaml.safe_load((ROOT / "infra/k8s/pod-template.yaml").read_text())
    validate(doc)
    params = next(e["value"] for e in doc["spec"]["containers"][0]["env"] if e["name"] == "EAGLE3_JOB_PARAMS")
    job = dataclasses.replace(extract(), params=from_json(ExtractJob, params))
    assert doc["spec"] == k8s_launcher().pod_spec(job)
    assert doc["metadata"]["labels"] == k8s_launcher().pod_meta(job)["labels"]


@pytest.fixture(scope="module")
def helm_values() -> dict:
    return yaml.safe_load((ROOT / "infra/helm/values.yaml").read_text())


def test_helm_values_set_what_they_claim(helm_values):
    v = helm_values
    assert v["postgresql"]["enabled"] is True and v["postgresql"]["postgresqlDatabase"]
    (dep,) = v["dagster-user-deployments"]["deployments"]
    assert v["dagster-user-deployments"]["enabled"] and dep["image"]["repository"].endswith("/eagle3-assets")
    assert dep["image"]["tag"] and dep["image"]["tag"] != "latest"
    assert dep["codeServerArgs"] == ["-m", "eagle3_assets.definitions"]
    assert (ROOT / "eagle3_assets/definitions.py").is_file()
    assert dep["includeConfigInLaunchedRuns"] == {"enabled": True}
    assert v["runLauncher"]["type"] == "K8sRunLauncher"
    daemon = v["dagsterDaemon"]
    assert daemon["enabled"] and daemon["runCoordinator"] == {
        "enabled": True,
        "type": "QueuedRunCoordinator",
        "config": {"queuedRunCoordinator": {}},
    }
    assert v["concurrency"]["enabled"] is True
    assert v["concurrency"]["pools"]["granularity"] == "run"
    assert isinstance(v["concurrency"]["pools"]["defaultLimit"], int) and v["concurrency"]["pools"]["defaultLimit"] >= 1
    assert daemon["runRetries"] == {"enabled": True, "maxRetries": 1, "retryOnAssetOrOpFailure": False}
    assert daemon["runMonitoring"]["enabled"] and daemon["runMonitoring"]["freeSlotsAfterRunEndSeconds"] == 30


def test_helm_kubernetes_fragments_validate(helm_values):
    """The user deployment's volumes, mounts and resources, and the run pods' config, are valid pod parts."""
    (dep,) = helm_values["dagster-user-deployments"]["deployments"]
    run = helm_values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "helm-fragments"},
        "spec": {
            **run["podSpecConfig"],
            "volumes": dep["volumes"],
            "containers": [
                {"name": "code", "image": "x", "volumeMounts": dep["volumeMounts"], "resources": dep["resources"]},
                {"name": "run", "image": "x", **run["containerConfig"]},
            ],
        },
    }
    validate(pod)
    # the user deployment mounts the shared volume where the GPU pods do
    assert {"name": "eagle3-data", "mountPath": "/data"} in dep["volumeMounts"]
    assert KubernetesSettings().volume_mounts == [{"name": "eagle3-data", "mountPath": "/data"}]
