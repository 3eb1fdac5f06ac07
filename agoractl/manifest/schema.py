"""The run manifest (apiVersion ``agoractl/v1``, kind ``Run``) as pydantic v2 models.

Every field carries an attribute docstring (units, defaults, sentinels) that becomes its description
in ``agoractl manifest schema``. Defaults follow the Agora report (seed 000) unless said otherwise.
Unknown keys are rejected everywhere (``extra="forbid"``); cross-field rules live in
:func:`cross_field_errors` so the loader can report them beside field errors, all at once.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import Field, ValidationInfo, model_validator

from agoractl.manifest.admission import Admission, admission_errors
from agoractl.manifest.dashboard import Dashboard
from agoractl.manifest.data import Data
from agoractl.manifest.hosts import Hosts, hosts_errors
from agoractl.manifest.monitoring import Monitoring
from agoractl.manifest.section import Section
from agoractl.manifest.validation import Validation
from agoractl.manifest.workers import Workers, workers_errors

API_VERSION = "agoractl/v1"
KIND = "Run"
BYTES_TOKENIZER_VOCAB = 257
"""The built-in byte tokenizer: ids 0-255 are bytes, 256 is end-of-document (EOS)."""


class Metadata(Section):
    name: str = Field("run", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    """Run name: lowercase letters, digits and dashes. Prefixes every DHT key of the run."""
    description: str = ""
    """Free text shown by `manifest plan`."""


class SSN(Section):
    rank: Optional[int] = Field(None, gt=0)
    """Rank k of the reparameterized subspace network (report §4.1); null = dense boundaries."""
    seed: int = 0
    """Seed of the fixed orthonormal basis U_k and of the fixed token embedding, shared by all stages."""


class Surrogate(Section):
    forward_delay_ms: float = Field(0.0, ge=0)
    """Delay added to every forward pass of a surrogate stage, in milliseconds (report §3.5.1.1)."""
    backward_delay_ms: float = Field(0.0, ge=0)
    """Delay added to every backward pass of a surrogate stage, in milliseconds."""
    dummy_params: int = Field(0, ge=0)
    """Extra parameters per stage that inflate the averaging payload without taking part in compute."""


class Model(Section):
    family: Literal["llama", "surrogate"] = "llama"
    """`llama`: the real decoder; `surrogate`: linear stand-ins for fast system tests (report §3.5.1.1)."""
    vocab_size: int = Field(BYTES_TOKENIZER_VOCAB, gt=0)
    """Vocabulary size V (token ids 0..V-1)."""
    d_model: int = Field(64, gt=0)
    """Hidden width d."""
    n_layers: int = Field(4, gt=0)
    """Number of transformer blocks in the whole model; stage `layers` must sum to it."""
    n_heads: int = Field(4, gt=0)
    """Attention (query) heads per block; must divide d_model."""
    n_kv_heads: Optional[int] = Field(None, gt=0)
    """Key/value heads (grouped-query attention); null = n_heads. Must divide n_heads."""
    d_ff: int = Field(172, gt=0)
    """Inner width of the SwiGLU MLP."""
    seq_len: int = Field(128, gt=0)
    """Tokens per training sequence (samples are seq_len + 1 tokens: inputs and shifted labels)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    norm_eps: float = Field(1e-5, gt=0)
    """RMSNorm epsilon."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal initialisation of trainable weights."""
    ssn: SSN = SSN()
    """Reparameterized subspace network (report §4.1)."""
    surrogate: Surrogate = Surrogate()
    """Surrogate-only settings; ignored for family llama."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Tokenizer(Section):
    kind: Literal["bytes", "hf"] = "bytes"
    """`bytes`: built in, 257 ids (bytes + EOS); `hf`: a local `tokenizers` JSON file or directory."""
    path: Optional[str] = None
    """For kind hf: path to tokenizer.json or a directory holding it. Never downloaded at run time."""
    eos_token: Optional[str] = None
    """For kind hf: the end-of-document token; null = the tokenizer's first special token."""


class Stage(Section):
    role: Literal["head", "body", "tail", "whole"]
    """head owns the embedding, tail the final norm, LM head and loss, body only blocks; whole owns all of
    them (embedding to loss): the one stage of a run whose model is not split, served by whole-model replicas."""
    layers: int = Field(gt=0)
    """Transformer blocks in this stage."""
    name: Optional[str] = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,31}$")
    """Stage name (DHT keys, checkpoint paths); null = head, body-1, body-2, ..., tail (whole: whole)."""

    @property
    def embeds(self) -> bool:
        """Whether this stage owns the token embedding (it takes token ids, no wire tensor)."""
        return self.role in ("head", "whole")

    @property
    def computes_loss(self) -> bool:
        """Whether this stage owns the final norm, LM head and loss (it answers forward_backward)."""
        return self.role in ("tail", "whole")


class Optimizer(Section):
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay."""


class Schedule(Section):
    kind: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule after warm-up: cosine decay to min_lr_ratio x lr at max_steps, or constant."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer steps."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak (cosine only)."""


class Clipping(Section):
    mode: Literal["stagewise", "global", "none"] = "stagewise"
    """`stagewise` clips each stage on its own (report §4.3); `global` only in the central reference."""
    threshold: Optional[float] = Field(None, gt=0)
    """Per-stage gradient-norm threshold; null = 1/sqrt(S) for S stages (report §4.3)."""
    tail_multiplier: float = Field(2.0, gt=0)
    """The tail's threshold is multiplied by this (report §4.3: 2)."""


class Training(Section):
    global_batch_size: int = Field(16, gt=0)
    """Samples per optimizer step, counted collectively by all replicas of a stage."""
    max_steps: int = Field(100, gt=0)
    """Optimizer steps of the run."""
    until_step: Optional[int] = Field(None, gt=0)
    """Stop this launch after this step (a checkpoint is written there) while the schedule still runs to
    max_steps, so that a later launch without it resumes the same run; null = run to max_steps."""
    optimizer: Optimizer = Optimizer()
    schedule: Schedule = Schedule()
    clipping: Clipping = Clipping()
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute precision: bf16 autocast on CUDA; master weights and moments stay fp32."""
    seed: int = 0
    """Seed of parameter initialisation (identical in every replica of a stage)."""

    @property
    def stop_step(self) -> int:
        """The step this launch stops after: until_step, else max_steps."""
        return self.until_step or self.max_steps


class Sparta(Section):
    fraction: float = Field(0.05, gt=0, le=1)
    """Fraction p of parameters averaged per round; ceil(1/p) disjoint segments (report §4.2: 0.05)."""
    every_steps: int = Field(20, gt=0)
    """Stage steps between averaging rounds (report: 20)."""
    delta_rule: bool = True
    """Apply theta += avg - snapshot (report §4.2.2); false replaces with the average."""
    allreduce_timeout_s: float = Field(150.0, gt=0)
    """All-reduce timeout, in seconds (report §5.9.3: 150)."""
    matchmaking_timeout_s: float = Field(40.0, gt=0)
    """Matchmaking window, in seconds."""
    seed: int = 0
    """Seed of the segment tiling, derived by every replica, never broadcast."""
    wire_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of averaged values on the wire."""
    chunk_bytes: int = Field(2**19, ge=1024)
    """Size of one streamed all-reduce chunk, in bytes (hivemind's part size; every replica must agree)."""
    chunk_timeout_s: float = Field(30.0, gt=0)
    """A sender silent for this many seconds between chunks is banned from the round; a reducer gets twice it."""


class FGDiLoCo(Section):
    inner_steps: int = Field(50, gt=0)
    """H: inner AdamW steps per outer round."""
    outer_lr: float = Field(0.7, gt=0)
    """Outer SGD learning rate."""
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    """Outer SGD momentum."""
    nesterov: bool = True
    """Nesterov momentum in the outer step."""
    variant: Literal["diloco", "global_m1", "global_m1_local_m2", "local_m1_m2"] = "global_m1_local_m2"
    """Mixing variant of seed 002."""
    transport: Literal["direct", "hivemind"] = "direct"
    """How mixes travel: direct pushes between the stage's replicas (no matchmaking, runtime/direct_mixing.py; the
    timeouts below bound a mix's wait), or hivemind's averager (matchmaking, butterfly all-reduce)."""
    replicas: Optional[int] = Field(None, gt=0)
    """M of seed 002, the model replicas: each replica of each stage steps on its own count of
    training.global_batch_size / M samples (a step's batch exact, its loss comparable with central's and the
    simulator's), and trainers send block n of their samples to the replica of rank n mod R of every stage, so a
    pipeline is M pipelines that each hold a whole model. Null: the replicas count collectively through the DHT
    (the batch exact on average)."""
    allreduce_timeout_s: float = Field(150.0, gt=0)
    """All-reduce timeout of one mix, in seconds."""
    matchmaking_timeout_s: float = Field(40.0, gt=0)
    """Matchmaking window of one mix, in seconds."""
    wire_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of mixed values on the wire."""
    chunk_bytes: int = Field(2**19, ge=1024)
    """Size of one streamed all-reduce chunk, in bytes (hivemind's part size; every replica must agree)."""
    chunk_timeout_s: float = Field(30.0, gt=0)
    """A sender silent for this many seconds between chunks is banned from the mix; a reducer gets twice it."""


class DataParallel(Section):
    method: Literal["sparta", "fgdiloco", "none"] = "sparta"
    """How replicas of a stage stay in consensus."""
    sparta: Sparta = Sparta()
    fgdiloco: FGDiLoCo = FGDiLoCo()


class Join(Section):
    max_stale_steps: int = Field(5, ge=0)
    """A joining worker more than this many steps behind runs the sync phases (report §3.3.1.1)."""
    weight_sync_steps: int = Field(400, ge=0)
    """Stage steps of weight sync (invisible to trainers, averaging weight 0)."""
    optimizer_sync_steps: int = Field(100, ge=0)
    """Stage steps of optimizer sync (visible, trains, weight 0, reports no samples)."""


class Trainers(Section):
    count: int = Field(1, gt=0)
    """Trainers in the run (the ledger is sized by it)."""
    shards_per_trainer: int = Field(3, gt=0)
    """Data shards assigned to each trainer (report §5.1.0.2: 3)."""
    in_flight: int = Field(2, gt=0)
    """Microbatches each trainer keeps in flight (concurrent pipelines)."""
    microbatch: int = Field(1, gt=0)
    """Samples per request a trainer sends (report §3.3.1.3: 1, so any worker can serve any request and
    workers coalesce what queues up). Raise it where per-request overhead outweighs compute (a tiny model
    on one machine); keep it at most workers.max_microbatch."""
    discovery_period_s: float = Field(30.0, gt=0)
    """Seconds between DHT look-ups of each stage's workers (report §3.3.2.2: ~30)."""
    record_sequences: bool = False
    """Keep every completed sequence's [shard, epoch, token offset, step] in the trainer's stats (audits
    that no sequence is trained twice, e.g. across a resume), and log each sample's [shard, epoch, offset]
    as it is settled (``sequences settled``, completed or given up: the record of a trainer killed before
    it wrote its stats); one entry per sample, so off by default."""
    ban_s: float = Field(60.0, ge=0)
    """Seconds a failed worker stays banned."""
    retries: int = Field(3, ge=0)
    """Re-dispatches of one request to other replicas before the sample is counted as lost."""
    request_timeout_s: float = Field(60.0, gt=0)
    """Seconds to wait for one forward or backward reply."""
    stall_timeout_s: float = Field(300.0, ge=0)
    """Seconds without a completed sample after which a trainer (`launch trainer`) says which stage it cannot
    reach and exits with code 3; 0 = never. `launch swarm` turns it off in its trainers: it watches the
    whole run itself (local.stall_timeout_s) and starts what died again."""


class Checkpoints(Section):
    store: str = "runs/local-cpu/store"
    """Checkpoint store: local path, file:// or s3:// URL. Credentials come from the environment."""
    every_steps: int = Field(50, ge=0)
    """Operator workers publish every this many steps; 0 = never."""
    keep_last: int = Field(3, gt=0)
    """Checkpoints kept per stage."""
    snapshots_every_steps: int = Field(0, ge=0)
    """Every worker writes a replica snapshot this often, for divergence analysis; 0 = never."""


class Network(Section):
    initial_peers: list[str] = []
    """Multiaddrs of DHT peers to join; empty = start a new DHT."""
    host_maddrs: list[str] = ["/ip4/127.0.0.1/tcp/0"]
    """Multiaddrs to listen on."""
    announce_maddrs: list[str] = []
    """Multiaddrs announced to others; empty = the host addresses."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """Seconds to wait for the p2p daemon to start."""
    p2pd_max_procs: Optional[int] = Field(None, gt=0)
    """Threads running the Go code of each node's p2pd daemon at once (its GOMAXPROCS); null = the
    environment's GOMAXPROCS, else one per core. On a 2-core machine 1 saved nothing over null once GC was
    rarer (bench-cpu: swarm/central 0.72 against 0.77), and a node's start took 0.5 s longer."""
    p2pd_gc_percent: Optional[int] = Field(None, gt=0)
    """Heap growth, in percent, between the p2pd daemon's garbage collections (its GOGC); null = the
    environment's GOGC, else Go's 100. At 100 the daemons spent about 50% more CPU per sample on bench-cpu than
    at 400 (benchmarks/swarm_vs_central.py); 400 is not the default yet: with it, a CI run's SPARTA tests'
    peers failed to reach their seed (under heavy load; not yet understood)."""


class Local(Section):
    workers_per_stage: int = Field(1, gt=0)
    """Workers per stage that `launch swarm` starts on this machine."""
    trainers: int = Field(1, ge=0)
    """Trainers that `launch swarm` starts (0 only with workers.self_feed: the replicas read their own samples)."""
    start_with_workers: Optional[int] = Field(None, gt=0)
    """Live workers every stage needs before the swarm's trainers send their first sample (null:
    ``workers_per_stage``); more when workers started by hand are to take part from the first step."""
    threads_per_process: int = Field(1, gt=0)
    """torch threads in each started process."""
    run_dir: str = "runs/local-cpu"
    """Where `launch swarm` and `launch central` write logs and the run report."""
    max_restarts: int = Field(3, ge=0)
    """Times `launch swarm` starts each worker or trainer again after its process exited (any exit code,
    killed, or a self-termination rule), counted per node like torchrun's --max-restarts; 0 = never."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Seconds before a node's first restart, doubled for each further restart of the same node (at most
    60 s)."""
    stall_timeout_s: float = Field(300.0, gt=0)
    """Seconds without a completed optimizer step after which `launch swarm` says why the run stalled, and
    ends it (exit code 3) when no restart is pending."""
    hosts: Hosts = Hosts()
    """Emulated hosts: every node in its own network namespace, links shaped (root only; agoractl.manifest.hosts)."""


class Run(Section):
    """A whole training run: model, stages, optimisation, data, storage, network."""

    apiVersion: Literal["agoractl/v1"] = API_VERSION
    """Manifest format version."""
    kind: Literal["Run"] = KIND
    """Always Run."""
    metadata: Metadata = Metadata()
    model: Model = Model()
    tokenizer: Tokenizer = Tokenizer()
    stages: list[Stage] = Field(
        default_factory=lambda: [Stage(role="head", layers=2), Stage(role="body", layers=1), Stage(role="tail", layers=1)]
    )
    """Pipeline stages in order: one head first, any bodies, one tail last; or a single stage of role whole
    (the model not split: whole-model replicas, data parallelism only)."""
    training: Training = Training()
    data_parallel: DataParallel = DataParallel()
    join: Join = Join()
    workers: Workers = Workers()
    trainers: Trainers = Trainers()
    validation: Validation = Validation()
    admission: Admission = Admission()
    monitoring: Monitoring = Monitoring()
    dashboard: Dashboard = Dashboard()
    data: Data = Data()
    checkpoints: Checkpoints = Checkpoints()
    network: Network = Network()
    local: Local = Local()

    @model_validator(mode="after")
    def _cross_fields(self, info: ValidationInfo) -> "Run":
        if info.context and info.context.get("skip_cross_fields"):
            return self
        problems = cross_field_errors(self)
        if problems:
            raise ValueError("; ".join(f"{path}: {msg}" for path, msg in problems))
        return self

    def stage_names(self) -> list[str]:
        return stage_names(self.stages)

    def stage(self, name: str) -> tuple[int, Stage]:
        """The index and definition of stage `name`; KeyError listing the valid names otherwise."""
        names = self.stage_names()
        if name not in names:
            raise KeyError(f"no stage {name!r}; stages are {', '.join(names)}")
        return names.index(name), self.stages[names.index(name)]

    def layer_range(self, index: int) -> tuple[int, int]:
        """Global block indices [start, stop) owned by stage `index`."""
        start = sum(s.layers for s in self.stages[:index])
        return start, start + self.stages[index].layers

    def clip_threshold(self, index: int) -> Optional[float]:
        """Stage-wise clipping threshold of stage `index` (report §4.3), or None when not clipping."""
        c = self.training.clipping
        if c.mode == "none":
            return None
        base = c.threshold if c.threshold is not None else 1.0 / math.sqrt(len(self.stages))
        if c.mode == "global":
            return c.threshold if c.threshold is not None else 1.0
        # A whole stage is the whole model: stage-wise is global clipping (1/sqrt(1) = 1), no tail multiplier.
        return base * (c.tail_multiplier if self.stages[index].role == "tail" else 1.0)

    @property
    def replica_batch(self) -> Optional[int]:
        """Samples per inner step of a replica on its own count (fgdiloco.replicas = M: global batch / M), or None."""
        fg = self.data_parallel.fgdiloco
        ok = self.data_parallel.method == "fgdiloco" and fg.replicas is not None
        return self.training.global_batch_size // fg.replicas if ok else None

    def n_segments(self) -> int:
        """SPARTA segments: ceil(1 / fraction) (20 at 5%)."""
        return math.ceil(1.0 / self.data_parallel.sparta.fraction - 1e-9)


def stage_names(stages: list[Stage]) -> list[str]:
    """Explicit names, else head / body-1..body-N / tail (or whole) by role."""
    names, body = [], 0
    for s in stages:
        if s.role == "body":
            body += 1
        names.append(s.name or (f"body-{body}" if s.role == "body" else s.role))
    return names


def cross_field_errors(run: Run) -> list[tuple[str, str]]:
    """Rules that span fields, as (dotted path, message) pairs; empty when the manifest is coherent."""
    out: list[tuple[str, str]] = []
    m = run.model
    if m.d_model % m.n_heads:
        out.append(("model.n_heads", f"must divide model.d_model ({m.d_model}); got {m.n_heads}"))
    elif m.head_dim % 2 and m.family == "llama":
        out.append(("model.n_heads", f"head dimension d_model/n_heads = {m.head_dim} must be even for RoPE"))
    if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        out.append(("model.n_kv_heads", f"must divide model.n_heads ({m.n_heads}); got {m.n_kv_heads}"))
    if m.ssn.rank is not None and m.ssn.rank >= m.d_model:
        out.append(("model.ssn.rank", f"must be below model.d_model ({m.d_model}); got {m.ssn.rank}"))
    if m.family == "surrogate" and m.ssn.rank is not None:
        out.append(("model.ssn.rank", "the surrogate family has dense boundaries; set model.ssn.rank to null"))
    if run.tokenizer.kind == "bytes" and m.vocab_size < BYTES_TOKENIZER_VOCAB:
        out.append(("model.vocab_size", f"the bytes tokenizer needs at least {BYTES_TOKENIZER_VOCAB}; got {m.vocab_size}"))
    if run.tokenizer.kind == "hf" and not run.tokenizer.path:
        out.append(("tokenizer.path", "tokenizer.kind hf needs a path to a local tokenizer.json"))
    stages = run.stages
    roles = [s.role for s in stages]
    if not stages:
        out.append(("stages", "a run needs one stage of role whole, or a pipeline from a head to a tail"))
    elif len(stages) == 1 and roles[0] != "whole":
        out.append(("stages[0].role", f"a single stage holds the whole model: role whole; got {roles[0]}"))
    elif len(stages) > 1 and "whole" in roles:
        out.append((f"stages[{roles.index('whole')}].role", "whole is for a run of one stage; a pipeline has "
                                                             "a head, any bodies and a tail"))
    elif len(stages) > 1:
        if roles[0] != "head" or roles.count("head") != 1:
            out.append(("stages[0].role", "exactly one head stage, and it must come first"))
        if roles[-1] != "tail" or roles.count("tail") != 1:
            out.append((f"stages[{len(stages) - 1}].role", "exactly one tail stage, and it must come last"))
    total = sum(s.layers for s in stages)
    if stages and total != m.n_layers:
        detail = " + ".join(str(s.layers) for s in stages)
        out.append(("stages", f"stage layers sum to {total} ({detail}) but model.n_layers is {m.n_layers}"))
    names = stage_names(stages)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        out.append(("stages", f"stage names must be unique; repeated: {', '.join(dupes)}"))
    out += workers_errors(run.workers, roles, run.replica_batch, run.local.trainers)
    out += admission_errors(run.admission, names)
    if run.dashboard.enabled and not run.monitoring.enabled:
        out.append(("dashboard.enabled", "needs monitoring.enabled: the Dashboard reads the Health Monitor's database"))
    if run.data.heldout_shards >= run.data.num_shards:
        out.append(("data.heldout_shards", f"must be below data.num_shards ({run.data.num_shards}): trainers need "
                                           f"a shard; got {run.data.heldout_shards}"))
    out += hosts_errors(run.local.hosts, names, run.local.workers_per_stage)
    if run.training.schedule.warmup_steps > run.training.max_steps:
        out.append(("training.schedule.warmup_steps",
                    f"exceeds training.max_steps ({run.training.max_steps})"))
    if (run.training.until_step or 0) > run.training.max_steps:
        out.append(("training.until_step", f"exceeds training.max_steps ({run.training.max_steps})"))
    batch = run.replica_batch or run.training.global_batch_size
    if run.trainers.microbatch > batch:
        out.append(("trainers.microbatch", f"must be at most a step's batch ({batch} samples): a larger request "
                                           f"overshoots it; got {run.trainers.microbatch}"))
    replicas = run.data_parallel.fgdiloco.replicas
    if replicas is not None and run.training.global_batch_size % replicas:
        out.append(("data_parallel.fgdiloco.replicas", f"must divide training.global_batch_size "
                                                       f"({run.training.global_batch_size}); got {replicas}"))
    return out
