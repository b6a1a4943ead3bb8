"""launch/kubernetes: every manifest validates, and each pod's command line trains when run here.

No cluster runs here. Kubernetes resources are validated strictly (unknown fields fail)
against the published schemas with kubernetes-validate. The PyTorchJob is a custom resource
whose openAPIV3Schema no PyPI or Debian package ships (the kubeflow-training SDK has only the
generated model classes; the CRD lives in the operator's repository): it is validated by
deserialising it into the SDK's own model classes, which must take every field (a round trip
that drops nothing), plus the operator's documented enums; its pod template is validated
strictly as a core/v1 PodTemplate.

Each manifest comes as a CPU and a CUDA variant that differ only in image, workers per pod,
resources and /dev/shm size, and each fits the image launch/docker/Dockerfile builds: its tag, its
user, a memory-backed /dev/shm, requests that make the pod Guaranteed.

Then the container's own command and args (CPU variant) run as the "pods" of one job on 127.0.0.1: the
environment the kubelet and the operator would give (the PET_* torchrun flags, $(VAR)
expansion, secrets), with the rendezvous on loopback, one worker per pod instead of 8 GPUs, a
local snapshot directory instead of S3, and a few steps.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from elastictrain.launcher.launch import CONFIG_ERROR_EXIT_CODE, FAILED_EXIT_CODE, PREEMPTED_EXIT_CODE, RENDEZVOUS_LOST_EXIT_CODE
from elastictrain.storage.snapshot_store import SnapshotStore
from tests.conftest import REPO_ROOT, parse_job
from tests.helpers import procs
from tests.helpers.agents import free_port
from tests.test_launch_docker import build_args, image_user

kubernetes_validate = pytest.importorskip("kubernetes_validate.utils", reason="the test extra installs kubernetes-validate")

MANIFEST_DIR = REPO_ROOT / "launch" / "kubernetes"
VARIANTS = ("cpu", "cuda")
PYTORCHJOBS = {variant: MANIFEST_DIR / f"pytorchjob-{variant}.yaml" for variant in VARIANTS}
INDEXED_JOBS = {variant: MANIFEST_DIR / f"indexed-job-{variant}.yaml" for variant in VARIANTS}
PYTORCHJOB, INDEXED_JOB = PYTORCHJOBS["cpu"], INDEXED_JOBS["cpu"]  # the ones run here: no GPU
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
# Oldest and newest Kubernetes versions the manifests are checked against: podFailurePolicy
# with onPodConditions DisruptionTarget is GA from 1.31 on.
KUBERNETES_VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]
TIMEOUT_S = 120
STEPS = 20
TRAINING = re.compile(r"\bstep \d+ epoch")  # rank 0's log line every train.log_every_steps
# The operator's enums (kubeflow.org/v1 types, quoted in the SDK's docstrings).
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
RDZV_BACKENDS = {"c10d", "etcd", "etcd-v2"}
REPLICA_TYPES = {"Master", "Worker"}


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_manifests() -> list[Path]:
    return sorted(MANIFEST_DIR.glob("*.yaml"))


def test_every_manifest_is_covered():
    assert set(all_manifests()) == {*PYTORCHJOBS.values(), *INDEXED_JOBS.values()}, "a new manifest needs its checks here"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", all_manifests(), ids=lambda p: p.name)
def test_kubernetes_resources_validate_strictly(path, version):
    for doc in documents(path):
        if doc["kind"] == "PyTorchJob":
            # The custom resource itself is checked below; its pod template is core/v1.
            for replica_type, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                                "metadata": {"name": f"{doc['metadata']['name']}-{replica_type.lower()}"},
                                "template": replica["template"]}
                kubernetes_validate.validate(pod_template, version, strict=True)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def _quantities_as_strings(value, under_resources: bool = False):
    """The SDK types resource quantities (``nvidia.com/gpu: 8``) as strings; compare them so."""
    if isinstance(value, dict):
        return {k: _quantities_as_strings(v, under_resources or k in ("limits", "requests")) for k, v in value.items()}
    if isinstance(value, list):
        return [_quantities_as_strings(v, under_resources) for v in value]
    return str(value) if under_resources and isinstance(value, (int, float)) else value


@pytest.mark.slow
@pytest.mark.parametrize("path", PYTORCHJOBS.values(), ids=lambda p: p.name)
def test_pytorchjob_matches_the_operator_sdk_models(path):
    training = pytest.importorskip("kubeflow.training", reason="the test extra installs kubeflow-training (the operator's SDK)")
    (job,) = [doc for doc in documents(path) if doc["kind"] == "PyTorchJob"]
    client = training.ApiClient()
    # ApiClient.deserialize takes an HTTP response; __deserialize is the same without one.
    model = client._ApiClient__deserialize(job, "KubeflowOrgV1PyTorchJob")
    assert isinstance(model, training.KubeflowOrgV1PyTorchJob)
    round_trip = client.sanitize_for_serialization(model)
    assert round_trip == _quantities_as_strings(job), "a field the SDK does not know was dropped (misspelt or misplaced)"

    spec = model.spec
    assert spec.run_policy is not None and set(spec.pytorch_replica_specs) <= REPLICA_TYPES
    elastic = spec.elastic_policy
    assert elastic.rdzv_backend in RDZV_BACKENDS
    assert 1 <= elastic.min_replicas <= spec.pytorch_replica_specs["Worker"].replicas <= elastic.max_replicas
    for replica in spec.pytorch_replica_specs.values():
        assert replica.restart_policy in RESTART_POLICIES
        assert isinstance(replica.replicas, int)
        containers = replica.template.spec.containers
        assert "pytorch" in [c.name for c in containers], "the operator injects its variables into the container named pytorch"


def trainer_container(doc: dict) -> tuple[dict, dict]:
    """(pod spec, the training container) of a PyTorchJob's Worker or a Job's pod template."""
    if doc["kind"] == "PyTorchJob":
        pod = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        name = "pytorch"
    else:
        pod = doc["spec"]["template"]
        name = pod["spec"]["containers"][0]["name"]
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return pod, container


@pytest.mark.parametrize("path", all_manifests(), ids=lambda p: p.name)
def test_metrics_port_preemption_budget_and_secrets_fit_together(path):
    doc = next(d for d in documents(path) if d["kind"] in ("PyTorchJob", "Job"))
    pod, container = trainer_container(doc)
    env = {e["name"]: e for e in container["env"]}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == env["METRICS_PORT"]["value"], "Prometheus must scrape the port elastictrain serves"
    assert "metrics.port=$(METRICS_PORT)" in container["args"]
    assert int(env["METRICS_PORT"]["value"]) in [p["containerPort"] for p in container["ports"]]

    script = container["command"][2]
    shutdown_timeout_s = int(re.search(r"--shutdown-timeout=(\d+)", script).group(1))
    assert pod["spec"]["terminationGracePeriodSeconds"] > shutdown_timeout_s, "the kubelet must not SIGKILL before torchrun's own deadline"
    assert "SIGTERM" in re.search(r"--signals-to-handle=(\S+)", script).group(1)

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], f"{name} comes from a Secret, never a literal"
    if doc["kind"] == "PyTorchJob":
        assert doc["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    else:
        ignored = [r for r in doc["spec"]["podFailurePolicy"]["rules"] if r["action"] == "Ignore" and "onExitCodes" in r]
        assert any(143 in r["onExitCodes"]["values"] for r in ignored), "a preempted pod (exit 143) must not count as a failure"


def workload(path: Path) -> dict:
    """The PyTorchJob or Job of a manifest file."""
    return next(d for d in documents(path) if d["kind"] in ("PyTorchJob", "Job"))


def workers_per_pod(doc: dict, container: dict) -> int:
    return int(doc["spec"]["nprocPerNode"] if doc["kind"] == "PyTorchJob" else container_env_value(container, "PET_NPROC_PER_NODE"))


def without_variant(doc: dict) -> dict:
    """The manifest with what a variant may change taken out: image, workers per pod, resources, /dev/shm size."""
    doc = yaml.safe_load(yaml.safe_dump(doc))
    pod, container = trainer_container(doc)
    for key in ("image", "resources"):
        container.pop(key)
    if doc["kind"] == "PyTorchJob":
        doc["spec"].pop("nprocPerNode")
    else:
        container["env"] = [e for e in container["env"] if e["name"] != "PET_NPROC_PER_NODE"]
    for volume in pod["spec"]["volumes"]:
        volume.get("emptyDir", {}).pop("sizeLimit", None)
    return doc


@pytest.mark.parametrize("variants", [PYTORCHJOBS, INDEXED_JOBS], ids=["pytorchjob", "indexed-job"])
def test_the_cpu_and_cuda_variants_differ_only_in_image_workers_resources_and_shm(variants):
    cpu, cuda = (documents(variants[variant]) for variant in VARIANTS)
    assert [without_variant(d) if d["kind"] != "Service" else d for d in cpu] == \
           [without_variant(d) if d["kind"] != "Service" else d for d in cuda]


def quantity_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text)).groups()
    return int(number) * 1024 ** (["", "Ki", "Mi", "Gi", "Ti"].index(unit or ""))


@pytest.mark.parametrize("path", all_manifests(), ids=lambda p: p.name)
def test_the_pod_fits_the_image_and_its_resources(path):
    doc = workload(path)
    pod, container = trainer_container(doc)
    variant = path.stem.rsplit("-", 1)[1]
    repository, tag = container["image"].rsplit(":", 1)
    torch_variant = tag.removeprefix(f"{VERSION}-")
    assert tag != torch_variant, f"{container['image']}: tag the image <version>-<TORCH_VARIANT>, {VERSION} is pyproject's"
    assert torch_variant == "cpu" if variant == "cpu" else re.fullmatch(r"cu\d+", torch_variant), \
        f"{path.name} runs the {torch_variant} build"
    assert build_args()["TORCH_VARIANT"] == "cpu" or variant != "cpu"

    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and str(security["runAsUser"]) == image_user(), "the image's user, never root"

    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory", "/dev/shm is 64 MB in a container unless a memory volume replaces it"

    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert requests == limits, "requests equal to limits: a Guaranteed pod, the last to be evicted"
    assert {"cpu", "memory"} <= set(requests)
    assert quantity_bytes(limits["memory"]) > quantity_bytes(volume["emptyDir"]["sizeLimit"]), "tmpfs pages count as memory"
    workers = workers_per_pod(doc, container)
    if variant == "cuda":
        assert int(limits["nvidia.com/gpu"]) == workers, "one worker per GPU"
    else:
        assert "nvidia.com/gpu" not in limits and workers <= int(requests["cpu"]), "one CPU for each worker at least"


def restart_policy_retries(doc: dict, exit_code: int) -> bool | None:
    """What the manifest's policy does with a pod that exits exit_code: True retry, False fail the job, None count it."""
    if doc["kind"] == "PyTorchJob":
        assert doc["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
        return exit_code >= 128  # Kubeflow's ExitCode: 1-127 permanent, 128-255 retryable
    for rule in doc["spec"]["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule and exit_code in rule["onExitCodes"]["values"]:
            assert rule["onExitCodes"]["operator"] == "In"
            return {"Ignore": True, "FailJob": False}[rule["action"]]
    return None


@pytest.mark.parametrize("path", all_manifests(), ids=lambda p: p.name)
def test_the_pod_runs_elastictrain_run_whose_exit_codes_the_restart_policy_tells_apart(path):
    doc = workload(path)
    _, container = trainer_container(doc)
    launcher = re.search(r"^\s*(\S+) --[\w-]+=", container["command"][2], re.M).group(1)
    assert launcher == "elastictrain-run", f"{path.name}: torchrun exits 1 for a signal and a config error alike"
    assert restart_policy_retries(doc, PREEMPTED_EXIT_CODE) is True
    assert restart_policy_retries(doc, CONFIG_ERROR_EXIT_CODE) is False
    # Pod 0 lost: a PyTorchJob recreates the others; a Job replaces them, counting them against backoffLimit.
    assert restart_policy_retries(doc, RENDEZVOUS_LOST_EXIT_CODE) is (True if doc["kind"] == "PyTorchJob" else None)
    assert restart_policy_retries(doc, FAILED_EXIT_CODE) is (False if doc["kind"] == "PyTorchJob" else None)


def expand_kubelet_vars(text: str, env: dict[str, str]) -> str:
    """$(NAME) -> env[NAME] where NAME is defined, $$ -> $, as the kubelet does for command and args."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_environment(doc: dict, container: dict, tmp_path: Path, *, nnodes: str, endpoint: str) -> dict[str, str]:
    """What a pod of this manifest sees, with the cluster-only parts replaced by local ones."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = f"test-{ref['name']}-{ref['key']}"  # unused: snapshots go to a local directory
    if doc["kind"] == "PyTorchJob":
        # What the operator injects from elasticPolicy (pkg/controller.v1/pytorch/elastic.go).
        elastic = doc["spec"]["elasticPolicy"]
        env.update({
            "PET_RDZV_BACKEND": elastic["rdzvBackend"],
            "PET_MAX_RESTARTS": str(elastic["maxRestarts"]),
            "PET_NPROC_PER_NODE": doc["spec"]["nprocPerNode"],
        })
    env.update({
        "PET_NNODES": nnodes,
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_NPROC_PER_NODE": "1",  # one CPU worker per pod instead of one per GPU
        # Stop waiting for more pods 1 s (not 30 s) after the minimum has joined.
        "PET_RDZV_CONF": "last_call_timeout=1",
        "PET_MONITOR_INTERVAL": "0.1",
        "SNAPSHOT_URL": str(tmp_path / "snapshots"),
        "METRICS_PORT": str(free_port()),
        # The image's PATH and packages: this interpreter's torchrun, this checkout.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    })
    return env


def pod_command(container: dict, env: dict[str, str], extra_args: list[str]) -> list[str]:
    return [expand_kubelet_vars(part, env) for part in [*container["command"], *container["args"]]] + extra_args


@pytest.mark.torchrun
def test_the_indexed_job_s_pod_command_line_trains_as_two_pods(tmp_path):
    """The PyTorchJob's two pods train in the eviction test below."""
    path = INDEXED_JOB
    doc = next(d for d in documents(path) if d["kind"] in ("PyTorchJob", "Job"))
    _, container = trainer_container(doc)
    nnodes = (f"{doc['spec']['elasticPolicy']['minReplicas']}:{doc['spec']['elasticPolicy']['maxReplicas']}"
              if doc["kind"] == "PyTorchJob" else container_env_value(container, "PET_NNODES"))
    endpoint = f"127.0.0.1:{free_port()}"
    pods = []
    for index in range(2):
        env = pod_environment(doc, container, tmp_path, nnodes=nnodes, endpoint=endpoint)
        command = pod_command(container, env, [f"train.max_steps={STEPS}", "log.plots=false"])
        pods.append(procs.launch(command, log_path=tmp_path / f"pod-{index}.log", env=env, cwd=tmp_path))
    codes = [pod.wait(TIMEOUT_S) for pod in pods]
    output = "\n".join(pod.output() for pod in pods)
    assert codes == [0, 0], output[-4000:]
    summary = parse_job(output).summary
    assert (summary["state"], summary["step"], summary["world_size"]) == ("DONE", str(STEPS), "2")
    assert (tmp_path / "snapshots").is_dir(), "snapshot.durable.url=$(SNAPSHOT_URL) must reach elastictrain"
    assert all(pod.leftover_pids() == [] for pod in pods)


def container_env_value(container: dict, name: str) -> str:
    return next(e["value"] for e in container["env"] if e["name"] == name)


@pytest.mark.torchrun
def test_a_config_error_in_a_pod_exits_with_the_code_that_fails_the_indexed_job(tmp_path):
    doc = workload(INDEXED_JOB)
    _, container = trainer_container(doc)
    env = pod_environment(doc, container, tmp_path, nnodes="1", endpoint=f"127.0.0.1:{free_port()}")
    env["PET_MAX_RESTARTS"] = "0"  # each restart would fail the same way; one attempt shows the exit code
    pod = procs.launch(pod_command(container, env, ["train.max_epohcs=3"]), log_path=tmp_path / "pod.log", env=env, cwd=tmp_path)
    code = pod.wait(TIMEOUT_S)
    assert restart_policy_retries(doc, code) is False, f"exit {code} must match the FailJob rule\n{pod.output()[-3000:]}"
    assert "max_epohcs" in pod.output()


@pytest.mark.torchrun
def test_evicting_pod_0_ends_the_other_pod_with_a_code_the_pytorchjob_retries(tmp_path):
    """The PyTorchJob's pod command line trains as two pods. Pod 0's agent hosts the c10d store. SIGTERM to its PID 1
    (an eviction, or the kubelet's preemption: torchrun would exit 1): it snapshots and exits 143; the other pod loses
    the store and exits 200 (plain torchrun: 1, a permanent failure under restartPolicy ExitCode)."""
    doc = workload(PYTORCHJOB)
    _, container = trainer_container(doc)
    endpoint = f"127.0.0.1:{free_port()}"
    pods = []
    for index in range(2):
        env = pod_environment(doc, container, tmp_path, nnodes="2:4", endpoint=endpoint)
        # In a cluster pod 0 hosts the store because the endpoint is its name; here both pods are 127.0.0.1.
        env["PET_RDZV_CONF"] += f",is_host={int(index == 0)}"
        command = pod_command(container, env, ["train.max_epochs=100", "train.log_every_steps=5", "log.plots=false"])
        pods.append(procs.launch(command, log_path=tmp_path / f"pod-{index}.log", env=env, cwd=tmp_path))
    # Rank 0, which logs the steps, is on the pod whose agent has the lower pid (torch's rendezvous sorts the nodes by
    # host and pid): most often pod 0, launched first, but each pod's shell forks its agent, and under load pod 1's
    # may fork first (or pids wrap around): then pod 0 logs nothing, rank 1 logging warnings only.
    pods[0].wait_for(lambda _: any(TRAINING.search(pod.output()) for pod in pods), TIMEOUT_S, "training under way")
    os.kill(pods[0].proc.pid, signal.SIGTERM)
    codes = [pod.wait(TIMEOUT_S) for pod in pods]
    output = "\n".join(pod.output() for pod in pods)
    assert codes == [PREEMPTED_EXIT_CODE, RENDEZVOUS_LOST_EXIT_CODE], output[-6000:]
    assert "starting fresh (world size 2)" in output, output[-6000:]
    assert all(restart_policy_retries(doc, code) for code in codes)
    survivor = pods[1].output()
    assert "Traceback" not in survivor, survivor[-4000:]
    assert survivor.rstrip().splitlines()[-1].startswith("elastictrain-run: lost the rendezvous store at 127.0.0.1:"), \
        survivor[-2000:]
    (preempted,) = re.findall(r"preempted at step (\d+): snapshot committed", output)
    manifest, _ = SnapshotStore(str(tmp_path / "snapshots")).latest_valid()
    assert manifest.step == int(preempted)
    assert all(pod.leftover_pids() == [] for pod in pods)
