"""The Plan: the one hand-off between deciding (search) and applying (passes, runtime).

Frozen dataclasses, saved as versioned JSON. Loading checks the format version, and
``Plan.check(model_fingerprint, world_size)`` refuses a plan made for another model or mesh.
The predicted breakdown is stored in the plan, so ``explain`` renders a saved plan without
re-running the search.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from autopar.errors import AutoparError, PlanMismatchError

PLAN_VERSION = 1
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Each pipeline schedule's name in torch.distributed.pipelining (and torchtitan's configuration).
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                  "interleaved_zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}
# What a plan can be pinned to (``--pin``, ``estimate --plan``, ``autopar.compile(plan=...)``).
PIN_KEYS = {"tp", "pp", "dp", "dp_shard", "sp", "fsdp", "reshard", "mb", "schedule", "v", "ac", "once", "unit",
            "dp_overlap", "cp", "prefetch", "ep", "ep_overlap", "ep_nodes", "ep_fp8"}
# How another framework ran its collectives: `autopar estimate` prices them, the search never picks them.
ESTIMATE_ONLY = {"once": "autopar's executor gathers and reduces FSDP parameters per microbatch, or once per step "
                         "(once=gather, ZeRO-1), not gathered per microbatch and reduced once",
                 "unit": "autopar's executor gathers a layer's FSDP parameters in one collective",
                 "dp_overlap": "autopar's executor overlaps the gradient all-reduce with the backward",
                 "ep_overlap": "autopar's executor runs the expert all-to-alls between the layer's computations, "
                               "not under another microbatch's (DeepSeek's DualPipe)",
                 "ep_nodes": "autopar's executor sends each routed (token, expert) row to its expert's rank, "
                             "not each token once per node (DeepSeek's node-limited routing)",
                 "ep_fp8": "autopar's executor sends the routed rows in the compute dtype, not FP8"}
# The values of those keys that autopar's executor does run.
RUNS = {"once": ("", "gather"), "unit": ("layer",), "dp_overlap": (True,), "ep_overlap": (False,),
        "ep_nodes": (0,), "ep_fp8": (False,)}
# What the planner (``autopar explain --pin``) can be pinned to: the keys with a value it runs
# beyond the default.
PLANNED_KEYS = PIN_KEYS - {k for k, v in RUNS.items() if len(v) == 1}


@dataclass(frozen=True)
class Precision:
    """How a plan trains numerically: FSDP2's ``MixedPrecisionPolicy`` as one name. ``param``:
    the parameters the optimizer updates, their gradients and its state (the masters);
    ``compute``: the parameters as the step reads them (gathered in it), so matmuls and
    activations; ``reduce``: the gradients' reduce-scatter / all-reduce (torch dtype names)."""

    name: str
    param: str
    compute: str
    reduce: str
    runs: str = ""  # why ``autopar.compile`` does not run it ("" if it does)
    about: str = ""
    float8: bool = False  # the linears' matmuls in float8 (torchao's Float8Linear), the rest as ``compute``

    def bytes(self, what: str) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[getattr(self, what)]


PRECISIONS = {p.name: p for p in (
    Precision("fp32", "float32", "float32", "float32", about="fp32 throughout"),
    Precision("bf16-mixed", "float32", "bfloat16", "float32",
              about="fp32 master weights and optimizer state, bf16 compute and gathers, fp32 gradient reduction"),
    Precision("bf16-true", "bfloat16", "bfloat16", "bfloat16",
              about="bf16 weights, gradients and optimizer state, no fp32 masters"),
    Precision("fp16-mixed", "float32", "float16", "float32",
              runs="fp16 needs dynamic loss scaling, which autopar's step does not do; train with bf16-mixed",
              about="fp32 masters, fp16 compute, fp32 gradient reduction"),
    Precision("float8", "float32", "bfloat16", "float32", float8=True,
              runs="float8 linears (torchao's convert_to_float8_training) are priced, not applied by autopar's "
                   "executor; train with bf16-mixed, or price float8 with `autopar explain/estimate --precision float8`",
              about="bf16-mixed with the linears' matmuls in float8 (torchao, dynamic scaling), as torchtitan's "
                    "Float8 runs"),
)}
# Shorter names users type: "bf16" is what torchtitan and FSDP2 users mean by it (mixed, fp32 masters).
PRECISION_ALIASES = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "fp8": "float8", "float32": "fp32", "32": "fp32"}


def precision(name: str) -> Precision:
    """The precision called ``name`` (or one of its aliases)."""
    p = PRECISIONS.get(PRECISION_ALIASES.get(name, name)) if isinstance(name, str) else None
    if p is None:
        raise AutoparError(f"precision {name!r}: choose one of {', '.join(PRECISIONS)} "
                           f"({', '.join(f'{a} = {b}' for a, b in PRECISION_ALIASES.items() if a[0].isalpha())})")
    return p


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs pipeline stage ``stage`` (model order): looped, or V-shaped
    for ``zbv`` (odd chunks run on the ranks in reverse)."""
    chunk, r = divmod(stage, pp)
    return pp - 1 - r if schedule == "zbv" and chunk % 2 else r


def _short(v) -> str:
    """A field's value for a diff line: numbers at four significant digits, long lists by length."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and (len(v) > 6 or any(isinstance(x, (dict, list, tuple)) for x in v)):
        return f"{len(v)} entries"
    if isinstance(v, dict) and len(v) > 6:
        return f"{len(v)} keys"
    return repr(v) if isinstance(v, str) else str(v)


@dataclass(frozen=True)
class LayerPlan:
    fqn: str
    stage: int  # pipeline rank
    chunk: int  # virtual stage on that rank (interleaved schedules)
    ac: str  # none | selective | full


@dataclass(frozen=True)
class ShardRule:
    """How one module of a repeated block (or outside the blocks) is split under TP.

    ``colwise``/``rowwise``: Megatron column/row linear; ``tp_input``: the module holding a group of
    column linears, whose input is gathered (replicated) once for all of them; ``sequence``: a norm whose activations
    are split along the sequence under SP; ``vocab_embedding``/``vocab_head``: split along the
    vocabulary; ``replicate``: left whole.
    """

    scope: str  # block class name, or "outside"
    module: str  # module path within the scope (within the model for "outside")
    style: str


@dataclass(frozen=True)
class Plan:
    model_name: str
    model_fingerprint: str
    world_size: int
    hardware: str
    precision: str
    global_batch: int
    seq_len: int
    tp: int
    pp: int
    dp: int
    dp_shard: int
    sp: bool
    fsdp: bool
    reshard_after_forward: bool
    mb: int
    n_microbatches: int
    schedule: str
    v: int
    layers: tuple[LayerPlan, ...]
    shard_rules: tuple[ShardRule, ...]
    predicted: dict
    collectives: tuple[dict, ...]
    runners_up: tuple[dict, ...] = ()
    pins: dict = field(default_factory=dict)
    block_container: str = ""
    # Modules with parameters outside the blocks: (module, "pre" | "post", class name).
    outer_modules: tuple = ()
    # What the executor applied: (parameter, TP placement, dp_shard placement) per parameter, as
    # "R", "S(d)" or "S(d,xk)" (k interleaved parts), and why any linear stayed replicated.
    placements: tuple = ()
    tp_notes: tuple = ()
    # Choices made for the user that they should know about (e.g. a default sequence length).
    notes: tuple = ()
    # Under PP: each pipeline schedule's best prediction on this mesh (schedule, v, s/step, bubble).
    schedules: tuple = ()
    # FSDP: parameter buckets (one per layer) gathered ahead of their use (1: while the layer
    # before computes, as FSDP2 does); priced as (1 + prefetch) layers of gathered weights.
    fsdp_prefetch: int = 1
    # Context parallelism: each sequence split over ``cp`` ranks (a mesh dim between dp_shard and
    # tp); FSDP shards the parameters over dp_shard x cp. ``dp`` counts the batch's splits only.
    cp: int = 1
    # Expert parallelism: each routed experts' block's experts split over ``ep`` ranks carved out
    # of the data-parallel ones (not a mesh dim of its own: ``ep`` divides ``dp``).
    ep: int = 1
    # FSDP once per step (ZeRO-1, Megatron-LM's distributed optimizer): "gather" gathers each
    # parameter once at the step's start and keeps it whole for the step's microbatches, whose
    # gradients accumulate whole (in the reduce dtype) and are reduce-scattered once at its end;
    # the optimizer steps the shards. "": gathered and reduced per microbatch (ZeRO-3).
    fsdp_once: str = ""
    version: int = PLAN_VERSION

    # -- derived --------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp // self.dp_shard, self.dp_shard, self.cp, self.tp)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return MESH_DIMS

    def stage_index(self, rank: int, chunk: int) -> int:
        """The pipeline stage (model order) that pipeline rank ``rank`` runs as its ``chunk``-th
        virtual stage: looped (``chunk * pp + rank``), or V-shaped for ``zbv`` (rank r holds
        stages r and 2 pp - 1 - r, so the first and last stage share rank 0)."""
        if self.schedule == "zbv" and chunk % 2:
            return (chunk + 1) * self.pp - 1 - rank
        return chunk * self.pp + rank

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        return stage_rank(stage, self.pp, self.schedule)

    def ac_summary(self) -> str:
        modes = [l.ac for l in self.layers]
        kinds = sorted(set(modes))
        if len(kinds) == 1:
            return kinds[0]
        return ",".join(f"{k}:{modes.count(k)}" for k in ("none", "selective", "full") if k in modes)

    def as_config_string(self) -> str:
        """The ``key=value`` form that ``autopar estimate --plan`` and ``--pin`` accept."""
        s = (f"tp={self.tp},pp={self.pp},dp={self.dp},sp={int(self.sp)},fsdp={int(self.fsdp)},"
             f"mb={self.mb},ac={self.ac_summary() if ':' not in self.ac_summary() else 'mixed'}")
        if self.cp > 1:
            s += f",cp={self.cp}"
        if self.ep > 1:
            s += f",ep={self.ep}"
        if self.pp > 1:
            s += f",schedule={self.schedule},v={self.v}"
        if self.fsdp and self.fsdp_once:
            s += f",once={self.fsdp_once}"
        if self.fsdp and self.fsdp_prefetch != 1:
            s += f",prefetch={self.fsdp_prefetch}"
        return s

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        d["mesh_dim_names"] = list(MESH_DIMS)
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        version = d.get("version")
        if version is None and ("architectures" in d or "model_type" in d or "hidden_size" in d):
            raise AutoparError("this is a model config, not a plan: plan it with "
                               "'autopar explain config.json --gpus N -o plan.json', then show the plan")
        if version != PLAN_VERSION:
            raise PlanMismatchError(
                f"plan format version {version!r} is not supported (this autopar reads version "
                f"{PLAN_VERSION}); re-create the plan with 'autopar explain ... -o plan.json'"
            )
        d = {k: v for k, v in d.items() if k not in ("mesh_shape", "mesh_dim_names")}
        try:
            d["layers"] = tuple(LayerPlan(**x) for x in d["layers"])
            d["shard_rules"] = tuple(ShardRule(**x) for x in d["shard_rules"])
            d["collectives"] = tuple(d["collectives"])
            d["runners_up"] = tuple(d.get("runners_up", ()))
            d["outer_modules"] = tuple(tuple(x) for x in d.get("outer_modules", ()))
            d["placements"] = tuple(tuple(x) for x in d.get("placements", ()))
            d["tp_notes"] = tuple(d.get("tp_notes", ()))
            d["notes"] = tuple(d.get("notes", ()))
            d["schedules"] = tuple(d.get("schedules", ()))
            d["precision"] = precision(d["precision"]).name
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise AutoparError(f"plan JSON is missing or has unknown fields: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise AutoparError(f"plan is not valid JSON ({e}); save it again with autopar explain ... -o plan.json") from e
        if not isinstance(d, dict):
            raise AutoparError("plan JSON must be an object")
        return cls.from_dict(d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Plan:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise AutoparError(f"cannot read plan {path}: {e.strerror}") from e
        try:
            return cls.from_json(text)
        except AutoparError as e:
            raise type(e)(f"{path}: {e}") from e

    def check(self, *, model_fingerprint: str | None = None, world_size: int | None = None) -> None:
        if model_fingerprint is not None and model_fingerprint != self.model_fingerprint:
            raise PlanMismatchError(
                f"this plan was made for model {self.model_name} (fingerprint "
                f"{self.model_fingerprint}), not for this model (fingerprint {model_fingerprint}); "
                "plan this model instead"
            )
        if world_size is not None and world_size != self.world_size:
            raise PlanMismatchError(
                f"this plan is for {self.world_size} GPUs (mesh {dict(zip(MESH_DIMS, self.mesh_shape))}) "
                f"but the mesh has {world_size}; plan again for {world_size}"
            )

    def diff(self, other: Plan) -> list[str]:
        """Human-readable differences, field by field: another model first, runs of layers
        collapsed, numbers at four significant digits, long fields by their length."""
        a, b = self.to_dict(), other.to_dict()
        out = []
        if self.model_fingerprint != other.model_fingerprint:
            out.append(f"different models: {self.model_name} -> {other.model_name} (fingerprint "
                       f"{self.model_fingerprint} -> {other.model_fingerprint}): one plan cannot run the other's model")
        for k in sorted(set(a) | set(b)):
            if k in ("layers", "predicted", "collectives", "runners_up", "model_fingerprint", "model_name"):
                continue
            if a.get(k) != b.get(k):
                out.append(f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}")
        la, lb = self.layers, other.layers
        if len(la) != len(lb):
            out.append(f"layers: {len(la)} -> {len(lb)}")
        # Consecutive layers with the same change, as one line.
        runs: list[list] = []
        for x, y in zip(la, lb):
            if x == y:
                continue
            change = (f"{x.stage}/{x.chunk}/{x.ac}", f"{y.stage}/{y.chunk}/{y.ac}")
            if runs and runs[-1][2] == change and runs[-1][1].rsplit(".", 1)[0] == x.fqn.rsplit(".", 1)[0]:
                runs[-1][1] = x.fqn  # one stack per run (an encoder's, a decoder's), named as in this plan
            else:
                runs.append([x.fqn, x.fqn, change])
        for first, last, (was, now) in runs:
            span = first if first == last else f"{first} .. {last.rsplit('.', 1)[-1]}"
            out.append(f"{span} (stage/chunk/AC): {was} -> {now}")
        pa, pb = self.predicted, other.predicted
        for k in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "memory_gb_per_gpu"):
            if pa.get(k) != pb.get(k):
                out.append(f"predicted {k}: {_short(pa.get(k))} -> {_short(pb.get(k))}")
        return out
