"""The typed config tree, YAML loading, ``key.sub=value`` overrides and one-line error messages.

Validation is pydantic's; this module only turns its errors into the sentence a user needs:
the key path, what was given, what is expected and, for a misspelt key, the closest valid one.
``conf/default.yaml`` mirrors these defaults one to one (a test keeps them equal).
"""

from __future__ import annotations

import os
import re
import types
import typing
from typing import Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

DEFAULT_TASK_FACTORY = "elastictrain.train.tasks.spirals:build"


class _Section(BaseModel):
    # Unknown keys are errors (a misspelt key must never be silently ignored).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for an int or float: train.batch_size=true would train with batch 1.
        # A key's own validator (YAML's bare `off` for false) runs before this one.
        kind = number_kind(cls.model_fields[info.field_name].annotation) if info.field_name else None
        items = value if kind == "list" and isinstance(value, list) else [value] if kind else []
        if any(isinstance(item, bool) for item in items):
            raise ValueError("a boolean where a number is meant; write the number")
        return value


def number_kind(annotation: Any) -> str | None:
    """'number' for a key that holds an int or float (and no bool), 'list' for a list of them, else None."""
    if typing.get_origin(annotation) is typing.Annotated:
        return number_kind(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is list:
        return "list" if number_kind(typing.get_args(annotation)[0]) else None
    union = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    members = [typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m for m in union]
    if bool in members:
        return None
    return "number" if any(m in (int, float) for m in members) else None


class RunConfig(_Section):
    name: str = "default"  # names the run directory runs/<name> when `dir` is not set
    dir: str | None = None  # run directory; default runs/<name> under the working directory
    # Seeds Python's random, NumPy and torch (CUDA too) when the session is set up, the same on every rank: the
    # model's initial weights (and an EMA copy of them); from RESTORE, each rank's own streams (seed + rank, or the snapshot's).
    seed: int = 0


class TaskConfig(_Section):
    factory: str  # import path 'pkg.module:function' returning an elastictrain.Task
    args: dict[str, Any] = Field(default_factory=dict)  # keyword arguments for the factory


class TrainConfig(_Section):
    max_epochs: PositiveInt = 8
    max_steps: PositiveInt | None = None  # stop earlier, after this many optimizer steps
    batch_size: PositiveInt = 32  # per rank; the global batch is batch_size * world_size * grad_accum_steps
    grad_accum_steps: PositiveInt = 1  # micro-batches per optimizer step (all but the last under DDP no_sync)
    clip_grad_norm: PositiveFloat | None = None
    lr_scheduler_interval: Literal["step", "epoch"] = "step"
    eval_every_epochs: NonNegativeInt = 1  # 0: evaluate only at the end
    log_every_steps: PositiveInt = 25  # also how often losses are reduced across ranks
    # The Trainer's forward and evaluation (float16 adds a GradScaler if the task has none); a custom loop's
    # `with session.autocast():`, and a custom loop that sets it and never asks is warned at its first step.
    autocast_dtype: Literal["none", "bfloat16", "float16"] = "none"
    # When a restart brings another world size (an elastic job shrinking or growing):
    # keep_global_batch changes the accumulation so the global batch, the step count and the LR
    # schedule stay; keep_rank_batch keeps batch_size and grad_accum_steps, so the global batch follows.
    on_world_size_change: Literal["keep_global_batch", "keep_rank_batch"] = "keep_global_batch"
    scale_lr: bool = False  # keep_rank_batch only: scale the LR by new / old global batch (the linear rule)
    # The bitwise-elastic mode: 0 off. N (a power of two): the global batch is N virtual shards of
    # batch_size samples at any world size (which must divide N), each with its own RNG stream, their
    # gradients summed in one fixed tree, so a run that shrinks and grows ends bitwise equal to an unbroken one.
    virtual_shards: NonNegativeInt = 0
    # Bits depend on the thread count: auto pins every start to the count of the run's first start
    # (carried in the snapshot) and turns off the runtime's dynamic threading; N pins N; off leaves it all alone.
    intra_op_threads: PositiveInt | Literal["auto", "off"] = "auto"

    @field_validator("intra_op_threads", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        return (
            "off" if value is False else value
        )  # YAML reads a bare `off` as false (true is refused as for any number)


class DataConfig(_Section):
    shuffle: bool = True  # a fresh permutation per epoch from (run.seed, epoch)
    # Per rank: the Trainer's evaluation, a custom loop's session.val_loader() (one that sets it and builds none is warned).
    val_batch_size: PositiveInt = 256
    num_workers: NonNegativeInt = 0  # DataLoader worker processes


class DurableTierConfig(_Section):
    # snapshot.durable: the store every node can read (a shared path or an object store), written by rank 0;
    # every rank agrees on each write's outcome.
    # Any fsspec URL, used as given; default <run dir>/snapshots. memory:// lives in one process: refused under
    # torchrun with --max-restarts > 0, whose restarts are new processes.
    url: str | None = None
    every_steps: NonNegativeInt = 100  # 0: off
    # 0: off; rank 0's clock, from the newest durable snapshot (or the run's first start), across restarts
    every_s: NonNegativeFloat = 0.0
    keep_last: PositiveInt = 3  # older snapshots are deleted only after a newer one is committed
    # Write a final snapshot when training finishes (the fast tier gives its memory back then, so only this one stays).
    on_done: bool = True
    # Training waits only while rank 0 copies the state into reused CPU buffers; the write runs in a
    # thread, one at a time. Costs one more copy of the model and optimizer state in rank 0's memory.
    async_write: bool = False
    storage_options: dict[str, Any] = Field(default_factory=dict)  # passed to fsspec; secrets are never saved or logged
    on_error: Literal["stop", "continue"] = (
        "stop"  # a write that fails for good (disk full, denied): stop, or train on and retry next time
    )
    retry_for_s: PositiveFloat = (
        20.0  # an unreachable store is retried with backoff this long per commit, then training goes on
    )
    lease_stale_after_s: NonNegativeFloat = 60.0  # another run's store lease older than this is stale; 0: no lease


class LocalTierConfig(_Section):
    # snapshot.local, the fast tier: each node keeps its own full copies in node memory or on a node-local
    # disk, written by the node's local rank 0 (dist.strategy=fsdp: every rank writes its shards there and into
    # its peer node's copy, elastictrain/snapshot/fast_shards.py); a restart restores the newest snapshot any node or the
    # durable store holds. Unlike the durable tier it takes no storage options and no lease, a failed
    # copy is a warning and training goes on (there is no on_error), and a path that does not answer is
    # retried for at most min(2 s, snapshot.durable.retry_for_s).
    # A node-local path (tmpfs such as /dev/shm, or $SLURM_TMPDIR): ~ and $VARS are expanded and the
    # run's name appended (<url>/<run.name>). None: the fast tier is off.
    url: str | None = None
    every_steps: NonNegativeInt = 0  # 0: only at durable snapshots (when url is set)
    # Also every so many seconds (rank 0's clock; 0: off), or "auto": Young/Daly's interval
    # sqrt(2 x cost x time between failures), both measured in this run (elastictrain/snapshot/cadence.py).
    every_s: NonNegativeFloat | Literal["auto"] = 0.0
    # auto: the time between failures assumed before the run has measured it, weighted as one
    # failure's worth of evidence (0: none, the time trained so far stands in for it).
    mtbf_prior_s: NonNegativeFloat = 3600.0
    keep_last: PositiveInt = 2  # fast copies kept per node
    # The fast copies in the background too (its own setting: durable.async_write does not change it).
    # A copy into tmpfs is memory bandwidth, with no disk to wait on: where the CPU cores are all busy
    # training, a background write only competes with the step, and false costs less (benchmarks/README.md).
    async_write: bool = False
    # When a worker dies inside a step, the node's lowest surviving rank writes a fast copy of the step
    # before it (elastictrain/snapshot/survivor.py), so the restart redoes only that step. Across nodes too (the
    # other nodes' ranks restore their state from their own nodes' slots); models without floating-point buffers,
    # not dist.strategy=fsdp; each rank leaves ~12 KB per step in node memory.
    survivor_copies: bool = True


class SnapshotConfig(_Section):
    # Settings of both tiers stay here; each tier's own settings are in its section below.
    resume: bool = True  # restore the newest valid snapshot either tier holds at start
    # Config keys that may differ from the snapshot's on resume although they change the run's
    # data or batch geometry (run.seed, task.*, train.batch_size, train.grad_accum_steps,
    # data.shuffle); a key here also accepts every key below it.
    accept_changes: list[str] = Field(default_factory=list)
    durable: DurableTierConfig = Field(default_factory=DurableTierConfig)
    local: LocalTierConfig = Field(default_factory=LocalTierConfig)


PreemptSignal = Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"]


class PreemptConfig(_Section):
    # On one of these signals every rank finishes its step, rank 0 commits a snapshot and the
    # workers exit with code 143 (128 + SIGTERM), which every launcher treats as "terminated".
    signals: list[PreemptSignal] = Field(default_factory=lambda: list[PreemptSignal](["SIGTERM", "SIGINT", "SIGUSR1"]))
    requeue: bool = False  # under SLURM, `scontrol requeue $SLURM_JOB_ID` after a preemption snapshot
    # The ranks agree on signals (and rank 0's snapshot timer) at most once per step and at most this
    # often; a signal is acted on within max(one step, this) plus one step. 0: every step.
    vote_every_s: NonNegativeFloat = 0.25


class MetricsConfig(_Section):
    port: NonNegativeInt = 0  # Prometheus /metrics on rank 0 at this port; 0: off
    host: str = "0.0.0.0"  # address to bind (0.0.0.0: every interface, as prometheus-client does)
    per_node: bool = False  # each node's local rank 0 serves its own /metrics, labelled node=<node rank>


class WatchdogConfig(_Section):
    # A rank that makes no progress for its allowance is named by every live rank, dumps its stack
    # and exits 75, and torchrun restarts the group from the newest snapshot.
    hang_timeout_s: NonNegativeFloat = 30.0  # least allowance between two steps in TRAIN; 0: off
    step_multiple: PositiveFloat = 10.0  # allowances are at least this many times the longest step (or state) seen
    first_step_s: PositiveFloat = 600.0  # until the attempt's first step is done: warm-up, compilation, data workers
    restore_s: PositiveFloat = 600.0  # RESTORE: read, verify and broadcast the snapshot, retries included
    evaluate_s: PositiveFloat = 1800.0  # one whole EVALUATE (it has no step marks inside)
    snapshot_s: PositiveFloat = 600.0  # one SNAPSHOT, store retries included
    heartbeat_every_s: PositiveFloat = 1.0  # heartbeat to the launcher's store and self-check period


class StragglersConfig(_Section):
    factor: NonNegativeFloat = 2.0  # name a rank computing this many times the other ranks' median per step; 0: off
    min_excess_s: NonNegativeFloat = 0.005  # and slower by at least this much (scheduler noise names nobody)
    repeat_after_s: PositiveFloat = 300.0  # a rank that stays slow is named again after this long


class AnomalyConfig(_Section):
    """Self-healing (anomalies.py): what a non-finite or spiking step does."""

    policy: Literal["off", "skip", "rollback"] = (
        "rollback"  # skip: drop the step's update; rollback: replay it to tell data from fault
    )
    # The global gradient norm before every update: "auto" where it is had anyway (train.clip_grad_norm) or needed
    # (policy skip, spike_factor > 0); true: every step (one read of the gradients); the loss and, before each
    # snapshot, the weights are checked always.
    check_gradients: bool | Literal["auto"] = "auto"
    spike_factor: NonNegativeFloat = (
        0.0  # a gradient norm over this many times its running mean is an anomaly too; 0: off
    )
    warmup_steps: NonNegativeInt = 100  # steps of running mean before spikes are judged
    spike_window_steps: PositiveInt = 100  # the running mean's window (an exponential mean after warm-up)
    max_rollbacks: NonNegativeInt = 4  # rollbacks in the whole run; past it the run stops with every snapshot intact
    skip_samples: list[NonNegativeInt] = Field(default_factory=list)  # global sample indices never trained on

    @field_validator("policy", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false


class DistConfig(_Section):
    distributed: bool | Literal["auto"] = "auto"  # auto: from torchrun/SLURM variables
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: cuda:LOCAL_RANK if available)
    deterministic: bool = True  # on CUDA: deterministic algorithms and cuBLAS workspace (determinism.py); no-op on CPU
    find_unused_parameters: bool | None = None  # None: DDP_FIND_UNUSED_PARAMETERS or false
    sync_batchnorm: bool = False
    strategy: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 fully_shard, sharded snapshots (docs/guides/fsdp.md)
    init_timeout_s: PositiveFloat = 60.0  # store connection and process-group set-up
    collective_timeout_s: PositiveFloat = 300.0  # any single collective
    # Before every snapshot (both tiers) and at the end, the ranks compare a fingerprint of the registered models and
    # optimizers and stop on a difference (a model trained without its session.wrap() wrapper): elastictrain/health/replicas.py
    check_replicas: bool = True


class LogConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    progress_bar: bool | Literal["auto"] = "auto"  # auto: only when stderr is a terminal
    all_ranks: bool = False  # by default ranks other than 0 log warnings and errors only
    jsonl: bool = False  # rank 0 also writes one JSON object per log record to <run dir>/log.jsonl
    plots: bool = True  # at the end rank 0 draws loss and metric plots into <run dir>/plots (needs matplotlib)


class TrackConfig(_Section):
    # Experiment trackers on rank 0, each (name, step) written once a snapshot of its step commits (docs/guides/tracking.md).
    tensorboard: bool = False  # TensorBoard event files (pip install 'elastictrain[tensorboard]')
    tensorboard_dir: str = ""  # "": <run dir>/tensorboard
    mlflow_uri: str = ""  # an MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, a directory); "": off
    mlflow_experiment: str = ""  # "": run.name


class Config(_Section):
    """The whole validated config, one section per attribute (``cfg.train.max_epochs``); build it with ``load_config``."""

    run: RunConfig = Field(default_factory=RunConfig)
    task: TaskConfig = Field(default_factory=lambda: TaskConfig(factory=DEFAULT_TASK_FACTORY))
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    preempt: PreemptConfig = Field(default_factory=PreemptConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    stragglers: StragglersConfig = Field(default_factory=StragglersConfig)
    anomaly: AnomalyConfig = Field(default_factory=AnomalyConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    track: TrackConfig = Field(default_factory=TrackConfig)

    @model_validator(mode="after")
    def _storage_options_need_a_remote_store(self) -> Config:
        # An error, not a warning: options set for S3 with snapshot.url forgotten would otherwise
        # put every snapshot on this node's disk without a word.
        options = self.snapshot.durable.storage_options
        if options and is_local_url(self.durable_snapshot_url):
            raise ValueError(
                f"snapshot.durable.storage_options ({', '.join(map(str, options))}) are ignored for the local path "
                f"snapshot.durable.url={self.durable_snapshot_url!r}: they configure a remote store (credentials, "
                "endpoint); set snapshot.durable.url to the store they are for (e.g. s3://bucket/run) or remove them "
                "(snapshot.durable.storage_options={})"
            )
        return self

    @model_validator(mode="after")
    def _scale_lr_needs_a_changing_batch(self) -> Config:
        if self.train.scale_lr and self.train.on_world_size_change == "keep_global_batch":
            raise ValueError(
                "train.scale_lr=true does nothing with train.on_world_size_change=keep_global_batch (the global batch "
                "never changes); set train.on_world_size_change=keep_rank_batch, or train.scale_lr=false"
            )
        return self

    @model_validator(mode="after")
    def _virtual_shards_fix_the_batch(self) -> Config:
        train = self.train
        shards = train.virtual_shards
        if shards & (shards - 1):
            raise ValueError(
                f"train.virtual_shards={shards} must be a power of two (2, 4, 8, ...): the shards' gradients are summed "
                "in one binary tree, the same at every world size; pick the power of two at least as large as the "
                "largest world size the job may have"
            )
        if train.virtual_shards and (train.grad_accum_steps != 1 or train.on_world_size_change != "keep_global_batch"):
            raise ValueError(
                f"train.virtual_shards={train.virtual_shards} fixes the global batch at virtual_shards x batch_size "
                f"samples and derives each rank's accumulation from the world size; set train.grad_accum_steps=1 and "
                "train.on_world_size_change=keep_global_batch (the defaults), or train.virtual_shards=0"
            )
        return self

    @model_validator(mode="after")
    def _fsdp_alone(self) -> Config:
        if self.dist.strategy != "fsdp":
            return self
        conflicts = [
            (
                self.train.virtual_shards,
                "train.virtual_shards (its per-shard gradients need whole parameters)",
                "train.virtual_shards=0",
            ),
            (self.dist.sync_batchnorm, "dist.sync_batchnorm (a DDP conversion)", "dist.sync_batchnorm=false"),
            (
                self.snapshot.local.async_write,
                "snapshot.local.async_write (sharded fast copies are written in the step)",
                "snapshot.local.async_write=false",
            ),
        ]
        for value, what, fix in conflicts:
            if value:
                raise ValueError(f"dist.strategy=fsdp cannot be combined with {what}; set {fix}, or dist.strategy=ddp")
        return self

    @property
    def run_dir(self) -> str:
        return self.run.dir or os.path.join("runs", self.run.name)

    @property
    def durable_snapshot_url(self) -> str:
        """The durable tier's store: snapshot.durable.url as given, or <run dir>/snapshots."""
        return self.snapshot.durable.url or os.path.join(self.run_dir, "snapshots")

    @property
    def local_snapshot_url(self) -> str | None:
        """This node's fast tier, one directory per run name; None when the tier is off."""
        if not self.snapshot.local.url:
            return None
        return os.path.join(os.path.expandvars(os.path.expanduser(self.snapshot.local.url)), self.run.name)

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """The config as plain data; ``redact=True`` hides storage secrets (for snapshots and logs)."""
        data = self.model_dump(mode="json")
        if redact:
            durable = data["snapshot"]["durable"]
            durable["storage_options"] = redact_secrets(durable["storage_options"])
            data["track"]["mlflow_uri"] = re.sub(
                r"//[^/@]*@", f"//{REDACTED}@", data["track"]["mlflow_uri"]
            )  # user:password@
        return data


def is_local_url(url: str) -> bool:
    """True for a plain path or a file:// / local:// URL, where fsspec ignores storage options."""
    protocol, sep, _ = url.partition("://")
    return not sep or protocol.lower() in ("file", "local")


_SECRET_WORDS = ("secret", "password", "token", "credential", "key")
REDACTED = "<redacted>"


def redact_secrets(options: Any) -> Any:
    """A copy of storage options with every value under a secret-looking key replaced.

    ``key``/``secret``/``token``/``password`` and their ``aws_*`` spellings anywhere in the tree:
    a snapshot's saved config, a log line and an error message never carry a credential.
    """
    if isinstance(options, dict):
        return {
            name: REDACTED
            if isinstance(name, str) and _is_secret_name(name) and not isinstance(value, dict)
            else redact_secrets(value)
            for name, value in options.items()
        }
    if isinstance(options, list):
        return [redact_secrets(value) for value in options]
    return options


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS) and lowered not in ("key_prefix", "sse_kms_key_id")
