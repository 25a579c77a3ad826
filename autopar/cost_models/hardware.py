"""Hardware profiles: the numbers the cost model prices a plan with, as plain data.

A profile is JSON with the data-sheet fields ``name, peak_tflops, memory_gb,
memory_bandwidth_gbps, gpus_per_node, intra_node_gbps, inter_node_gbps`` (bandwidths per GPU per
direction, GB/s; memory in GiB) and optional calibration fields that ``autopar tune calibrate``
fits on a real machine:

- ``efficiency``: achieved fraction of peak for ``matmul`` and ``attention`` FLOPs, of memory
  bandwidth for ``memory``-bound ops, of link bandwidth for ``collective``; ``fusion`` is the
  fraction of element-wise bytes that remain after Inductor fuses them.
- ``latency_us``: per-step collective latency ``intra``/``inter`` node (the alpha of alpha-beta).
- ``collectives``: fitted alpha-beta pairs per collective and group size, which override the
  analytic ring model where present.
- ``reserve_gb``: memory the framework holds beyond the model (context, workspace, fragmentation).
- ``bandwidth_curve``: measured ``[[bytes_moved, GB/s], ...]`` of an element-wise op by size,
  ascending. A memory-bound op runs at the bandwidth interpolated (in log size) at the bytes it
  moves, instead of the flat ``memory_bandwidth_gbps`` (which the optimizer's in-place update
  uses): on GPUs small kernels never reach peak; on CPUs calibration stores one level, since fresh
  activation memory is page-fault bound at every size.
- ``compute_slots``: how many ranks' worth of compute a node runs at once (0: all of them, one
  device each). CPU processes sharing fewer cores than there are ranks set it (calibration
  measures it: the model's step on every rank at once against one rank alone); the step is then
  at least the node's total busy time divided by the slots.
- ``tp_linear_us``, ``sp_op_us``: framework time of eager tensor parallelism (DTensor dispatch)
  per sharded linear and per op run on sequence shards under SP (the norms), forward and
  backward together. Charged only for eager runs; compiled graphs trace it away.
- ``pp_microbatch_us``: the pipeline schedule's own time per microbatch and stage (forward and
  backward actions, beyond the activation transfers).
- ``precision``: the compute precision ``peak_tflops`` is for (``bf16`` on GPUs, ``fp32`` on CPUs);
  ``peak_tflops_fp32``: the fp32 peak where that differs (GPUs: the CUDA cores, since PyTorch's
  fp32 matmuls do not use TF32 by default). A precision without a peak of its own is priced at
  ``peak_tflops``. ``float8``: the GPU has float8 matmuls (priced at twice the bf16 peak).
- ``launch_us``: fixed time per executed op (framework dispatch and kernel launch); it matters for
  small models and CPU runs, not for large GPU matmuls.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from importlib import resources

from autopar.errors import AutoparError
from autopar.plan import precision as precision_of

DEFAULT_EFFICIENCY = {
    "matmul": 0.62,
    "attention": 0.45,
    "memory": 0.70,
    "collective": 0.75,
    "fusion": 0.5,
    # The share of a node's NICs that one cross-node ring collective drives at once: 1.0 when
    # the collective library spreads its rings over every rail (NCCL's ideal), 1/gpus_per_node
    # when a ring goes through one NIC (what ZeRO-3 at 384-2240 A100s measured in 2021).
    "fabric": 1.0,
}
REQUIRED = (
    "name", "peak_tflops", "memory_gb", "memory_bandwidth_gbps", "gpus_per_node",
    "intra_node_gbps", "inter_node_gbps",
)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float
    memory_gb: float
    memory_bandwidth_gbps: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    efficiency: dict = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    latency_us: dict = field(default_factory=lambda: {"intra": 4.0, "inter": 12.0})
    collectives: dict = field(default_factory=dict)
    reserve_gb: float = 2.0
    launch_us: float = 0.0  # fixed cost per executed op (eager dispatch, kernel launch)
    bandwidth_curve: list = field(default_factory=list)  # [[bytes moved, GB/s], ...] ascending
    compute_slots: float = 0.0  # ranks' worth of compute a node runs at once (0: a device per rank)
    tp_linear_us: float = 0.0  # eager DTensor overhead per TP linear (forward + backward)
    sp_op_us: float = 0.0  # eager DTensor overhead per op on sequence shards (forward + backward)
    pp_microbatch_us: float = 0.0  # pipeline schedule time per microbatch and stage
    precision: str = "bf16"
    peak_tflops_fp32: float = 0.0
    float8: bool = False  # float8 tensor cores (H100 and newer): matmuls at twice the bf16 peak
    note: str = ""

    def peak(self, compute: str | None) -> float:
        """TFLOP/s of matmuls computed in ``compute`` (a torch dtype name; None: the profile's own)."""
        if compute == "float32" and precision_of(self.precision).compute != "float32" and self.peak_tflops_fp32:
            return self.peak_tflops_fp32
        return self.peak_tflops

    def eff(self, key: str) -> float:
        return float(self.efficiency.get(key, DEFAULT_EFFICIENCY[key]))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_efficiency(self, **kw) -> Hardware:
        return dataclasses.replace(self, efficiency={**self.efficiency, **kw})


def _from_dict(d: dict, origin: str) -> Hardware:
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise AutoparError(f"hardware profile {origin} lacks {', '.join(missing)}; required: {', '.join(REQUIRED)}")
    known = {f.name for f in dataclasses.fields(Hardware)}
    kw = {k: v for k, v in d.items() if k in known}
    kw["efficiency"] = {**DEFAULT_EFFICIENCY, **d.get("efficiency", {})}
    checks = [(k, kw[k]) for k in ("peak_tflops", "memory_gb", "memory_bandwidth_gbps", "gpus_per_node",
                                   "intra_node_gbps", "inter_node_gbps") if k in kw]
    checks += [(f"efficiency.{k}", v) for k, v in kw["efficiency"].items()]
    for k, v in checks:
        try:
            ok = not isinstance(v, bool) and float(v) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise AutoparError(f"hardware profile {origin}: {k} must be a positive number, got {v!r}")
    for k in ("reserve_gb", "launch_us"):
        if k in kw and not (isinstance(kw[k], (int, float)) and kw[k] >= 0):
            raise AutoparError(f"hardware profile {origin}: {k} must be a number >= 0, got {kw[k]!r}")
    return Hardware(**kw)


def builtin_names() -> list[str]:
    files = resources.files("autopar.cost_models").joinpath("profiles").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".json"))


ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "cpu": "cpu-gloo"}


def load(spec: str | dict | Hardware) -> Hardware:
    """A profile by built-in name (``h100``, ``a100-80gb``...), JSON path, dict, or as is."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, dict):
        return _from_dict(spec, "(dict)")
    if os.path.exists(spec):
        with open(spec) as f:
            try:
                return _from_dict(json.load(f), spec)
            except json.JSONDecodeError as e:
                raise AutoparError(f"hardware profile {spec} is not valid JSON: {e}") from e
    name = ALIASES.get(spec.lower(), spec.lower())
    if name in builtin_names():
        text = resources.files("autopar.cost_models").joinpath("profiles", f"{name}.json").read_text()
        return _from_dict(json.loads(text), name)
    raise AutoparError(
        f"unknown hardware {spec!r}. Known: {', '.join(builtin_names())} "
        f"(aliases {', '.join(f'{a}={b}' for a, b in ALIASES.items())}), or a JSON file with "
        f"fields {', '.join(REQUIRED)}"
    )
