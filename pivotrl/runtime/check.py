"""Check a cluster config without GPUs or downloads: GPS placement, memory per node and device, transfer plans.

``python -m pivotrl.runtime.check CONFIG [key=value ...] [--json] [--node-memory-gib G] [--device H20]``
loads CONFIG like the launcher (``load_config(..., for_cluster_only=True)``), takes the policy and GenRM
shapes from ``pivotrl.gps.synthetic.model_spec_for`` (published config facts, or a local checkpoint's
safetensors headers) and states, for that config:

- GPS placement (App. B.1): ``place`` on the policy and the GenRM jointly, with the slots the runtime
  registers them with (``pipeline._gps``: the policy writable, 2 host copies; the GenRM 1), and the host
  bytes on the fullest node against the per-node budget (``--node-memory-gib``; None: unlimited);
- per-device memory of every role, summed exactly over the boxes ``device_layout`` gives each device
  (``role_memory``), against the device's HBM (``pivotrl.sim.catalog.DEVICES``);
- the plans (App. B.2, ``plan_operation``) of a Read by one rollout replica (its tp devices on node 0),
  a Read by one GenRM replica (same), and the Write by the training devices: the planned transfer time
  (``Plan.max_sender_latency_s`` under ``LinkProfile()``) and the planning compute time (wall clock).

Invariant: every figure comes from the same functions the runtime uses (``place``, ``device_layout``,
``plan_operation``); a config error is a ``ConfigError`` naming its key.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pivotrl.gps.layout import Layout, ModelSpec, Parallelism, device_layout
from pivotrl.gps.placement import Placement, place
from pivotrl.gps.plan import LinkProfile, plan_operation
from pivotrl.gps.synthetic import model_spec_for
from pivotrl.runtime.config import ConfigError, PipelineConfig, load_config
from pivotrl.runtime.pipeline import training_device_ids
from pivotrl.sim.catalog import DEVICES, DeviceSpec

__all__ = ["CheckReport", "RoleMemory", "TransferCheck", "check", "main", "model_specs", "role_memory"]

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SLOTS = {"policy": 2, "genrm": 1}  # host copies per model, as the runtime registers them (policy writable)


@dataclass(frozen=True, slots=True)
class RoleMemory:
    """What the fullest device of one role holds (bytes); ``state_bytes`` = weights for inference roles."""

    role: str  # rollout, reward or training
    model: str  # policy or genrm
    parallelism: str
    num_devices: int
    weight_bytes: int  # the device's share of the weights, in the role's dtype
    state_bytes: int  # training: weights + gradients + AdamW moments (``role_memory``)
    hbm_bytes: int

    @property
    def fits(self) -> bool:
        return self.state_bytes <= self.hbm_bytes


@dataclass(frozen=True, slots=True)
class TransferCheck:
    """One Read or Write: its plan's size, planned transfer time and planning compute time."""

    op: str  # read or write
    model: str
    role: str
    devices: tuple[int, ...]
    parallelism: str
    nbytes: int  # bytes the plan moves
    max_receiver_bytes: int  # bytes of the endpoint that receives most (a Read: one device's PCIe link carries them)
    num_transfers: int
    planned_s: float  # Plan.max_sender_latency_s: the slowest sender's estimated time
    planning_s: float  # wall time of plan_operation


@dataclass(frozen=True, slots=True)
class CheckReport:
    """Every figure ``check`` states for one config."""

    name: str
    models: dict[str, str]  # policy / genrm -> name or path
    model_params: dict[str, int]
    model_bytes: dict[str, int]  # as GPS stores them (checkpoint dtype; catalog models: bf16)
    num_nodes: int
    devices_per_node: int
    device: str
    placement: Placement
    roles: tuple[RoleMemory, ...]
    transfers: tuple[TransferCheck, ...]

    def to_dict(self) -> dict[str, Any]:
        p = self.placement
        return {"name": self.name, "models": self.models, "model_params": self.model_params,
                "model_bytes": self.model_bytes, "num_nodes": self.num_nodes,
                "devices_per_node": self.devices_per_node, "device": self.device,
                "placement": {"kind": "replicated" if p.is_replicated else "hybrid", "group_size": p.group_size,
                              "host_bytes_per_node": p.node_bytes, "host_gib_per_node": p.node_bytes / GIB,
                              "node_budget_bytes": p.node_budget_bytes, "reason": p.reason},
                "roles": [asdict(r) | {"fits": r.fits} for r in self.roles],
                "transfers": [asdict(t) for t in self.transfers]}


def model_specs(cfg: PipelineConfig) -> dict[str, ModelSpec]:
    """The policy's and the GenRM's ModelSpec; ConfigError naming ``models.<key>`` when one is unknown."""
    from pivotrl.runtime.config import TINY, TINY_MOE

    names = (cfg.models.policy, cfg.models.genrm)
    if TINY in names or TINY_MOE in names:  # the embedded checkpoints: shipped in the package
        from pivotrl.runtime.pipeline import embedded_checkpoints

        names = tuple(str(p) for p in embedded_checkpoints(names))  # type: ignore[assignment]
    out = {}
    for key, name in zip(("policy", "genrm"), names, strict=True):
        try:
            out[key] = model_spec_for(name)
        except ValueError as err:
            raise ConfigError(f"models.{key}: {err}") from None
    return out


def device_numel(layout: Layout) -> dict[int, int]:
    """Elements each device of ``layout`` holds: the sum of its boxes (exact, every parameter counted)."""
    out = dict.fromkeys(layout.endpoints, 0)
    for pieces in layout.pieces.values():
        for pc in pieces:
            n = pc.box.numel
            for d in pc.holders:
                out[d] += n
    return out


def role_memory(role: str, model: str, layout: Layout, parallelism: Parallelism, dtype: str,
                device: DeviceSpec) -> RoleMemory:
    """The fullest device's bytes. Inference roles: weights = elements x ``dtype`` size. Training (FSDP, each
    device a dim-0 chunk of every parameter), as ``GRPOTrainer`` keeps them: per element the parameter, its
    gradient and torch AdamW's two moments, all in ``trainer.dtype``: ``numel x 4 x dtype size``, 8 B for
    bf16 and 16 B for float32. Not counted: activations (they depend on the micro-batch), an fp32 master
    copy (``GRPOTrainer`` keeps none; mixed-precision trainers that do need +4 B/element, and +4 B more
    for fp32 moments)."""
    numel = max(device_numel(layout).values())
    size = DTYPE_BYTES[dtype]
    state = numel * 4 * size if role == "training" else numel * size
    return RoleMemory(role, model, _describe(parallelism), len(layout.endpoints), numel * size, state,
                      int(device.hbm_bytes))


def _describe(p: Parallelism) -> str:
    parts = [f"{k}={getattr(p, k)}" for k in ("dp", "tp", "pp", "ep") if getattr(p, k) > 1]
    return ", ".join(parts + (["FSDP"] if p.dp_shard else [])) or "1 device"


@dataclass(frozen=True, slots=True)
class _Role:
    """One role's devices as ``check`` lays it out, and the config key that sets them."""

    role: str
    model: str
    devices: tuple[int, ...]
    parallelism: Parallelism
    dtype: str  # the role's weight dtype (engine or trainer)
    key: str  # the config key at fault when the layout is impossible


def _roles(cfg: PipelineConfig, specs: dict[str, ModelSpec]) -> list[_Role]:
    """One rollout and one GenRM replica on node 0, and the training set (FSDP: a dim-0 chunk per device)."""
    ptp, gtp = cfg.models.policy_tp, cfg.models.genrm_tp
    ep = gtp if specs["genrm"].num_experts else 1  # an MoE GenRM: EP = TP (experts split across the tp devices)
    training = training_device_ids(cfg)
    fsdp = Parallelism(dp=len(training), dp_shard=len(training) > 1)
    return [_Role("rollout", "policy", tuple(range(ptp)), Parallelism(tp=ptp), cfg.rollout.dtype, "models.policy_tp"),
            _Role("reward", "genrm", tuple(range(gtp)), Parallelism(tp=gtp, ep=ep), cfg.genrm.dtype, "models.genrm_tp"),
            _Role("training", "policy", training, fsdp, cfg.trainer.dtype, "deployment.training_devices")]


def _max_receiver_bytes(plan: Any) -> int:
    per_target: dict[int, int] = {}
    for target, nbytes in zip(plan.target.tolist(), plan.nbytes.tolist(), strict=True):
        per_target[target] = per_target.get(target, 0) + nbytes
    return max(per_target.values(), default=0)


def check(cfg: PipelineConfig, *, node_budget_bytes: int | None = None, device: str = "H20",
          profile: LinkProfile | None = None) -> CheckReport:
    """All figures of the module docstring for ``cfg``."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {device!r}")
    spec_device, profile = DEVICES[device], profile or LinkProfile()
    specs = model_specs(cfg)
    try:
        placement = place(specs, num_nodes=cfg.cluster.num_nodes, node_budget_bytes=node_budget_bytes, slots=SLOTS)
    except ValueError as err:
        raise ConfigError(f"cluster.num_nodes: {err}") from None
    gps = {name: placement.layout(spec) for name, spec in specs.items()}
    roles, transfers = [], []
    for r in _roles(cfg, specs):
        try:
            layout = device_layout(specs[r.model], r.devices, r.parallelism)
        except ValueError as err:
            raise ConfigError(f"{r.key}: the {r.role} layout of models.{r.model} is impossible: {err}") from None
        roles.append(role_memory(r.role, r.model, layout, r.parallelism, r.dtype, spec_device))
        op = "write" if r.role == "training" else "read"
        start = time.perf_counter()
        plan = plan_operation(op, gps[r.model], r.devices, r.parallelism,
                              devices_per_node=cfg.cluster.devices_per_node, profile=profile)
        planning_s = time.perf_counter() - start
        transfers.append(TransferCheck(op, r.model, r.role, r.devices, _describe(r.parallelism),
                                       int(plan.nbytes.sum()), _max_receiver_bytes(plan), plan.num_transfers,
                                       plan.max_sender_latency_s,
                                       planning_s))
    return CheckReport(cfg.run.name, {"policy": cfg.models.policy, "genrm": cfg.models.genrm},
                       {k: sum(p.numel for p in s) for k, s in specs.items()}, {k: s.nbytes for k, s in specs.items()},
                       cfg.cluster.num_nodes, cfg.cluster.devices_per_node, device, placement, tuple(roles),
                       tuple(transfers))


# ---------------------------------------------------------------- output
def _gib(nbytes: float) -> str:
    """GiB, or MiB below 0.1 GiB (the embedded tiny models)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / (1 << 20):.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _span(devices: Sequence[int]) -> str:
    return f"{devices[0]}" if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"


def format_report(r: CheckReport) -> str:
    """The report as a readable table."""
    p, hbm = r.placement, DEVICES[r.device].hbm_bytes
    budget = "unlimited (no --node-memory-gib)" if p.node_budget_bytes is None else \
        f"{p.node_budget_bytes:,} B ({_gib(p.node_budget_bytes)})"
    lines = [f"{r.name}: {r.num_nodes} nodes x {r.devices_per_node} {r.device} ({hbm / 1e9:.0f} GB = {_gib(hbm)} "
             "HBM each)"]
    for key in ("policy", "genrm"):
        lines.append(f"  {key:<7} {r.models[key]}: {_params(r.model_params[key])} params, "
                     f"{r.model_bytes[key]:,} B ({_gib(r.model_bytes[key])})")
    lines += [f"GPS placement: {'replicated' if p.is_replicated else 'hybrid'}, k = {p.group_size} ({p.reason})",
              f"  host memory per node: {p.node_bytes:,} B ({_gib(p.node_bytes)}) "
              f"[policy x{SLOTS['policy']} (double-buffered), genrm x{SLOTS['genrm']}]; budget {budget}",
              f"{'role':<9} {'model':<6} {'devices':>7} {'parallelism':<14} {'weights/device':>15} "
              f"{'state/device':>13} {'HBM':>10} fits"]
    for m in r.roles:
        lines.append(f"{m.role:<9} {m.model:<6} {m.num_devices:>7} {m.parallelism:<14} {_gib(m.weight_bytes):>15} "
                     f"{_gib(m.state_bytes):>13} {_gib(m.hbm_bytes):>10} {'yes' if m.fits else 'NO'}")
    lines.append("  training state = parameters + gradients + 2 AdamW moments per element, all in trainer.dtype")
    lines.append(f"{'transfer':<14} {'devices':>7} {'parallelism':<14} {'bytes':>16} {'transfers':>9} "
                 f"{'planned ms':>10} {'planning ms':>11}")
    for t in r.transfers:
        lines.append(f"{t.op + ' ' + t.model:<14} {_span(t.devices):>7} {t.parallelism:<14} {t.nbytes:>16,} "
                     f"{t.num_transfers:>9} {t.planned_s * 1e3:>10.1f} {t.planning_s * 1e3:>11.1f}")
    lines.append("  planned ms: the plan's slowest sender (Plan.max_sender_latency_s, LinkProfile() link speeds); "
                 "planning ms: wall time to build the plan")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pivotrl.runtime.check", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a pipeline YAML file, e.g. launch/configs/paper/qwen2.5-7b_qwen3-30b-a3b.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for launch/pivotrl.py")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure as the last line")
    parser.add_argument("--node-memory-gib", type=float, default=None,
                        help="per-node host (CPU) memory GPS may use, GiB. Default: unlimited; neither the paper "
                             "(§8.1 states only 8 H20 GPUs per node) nor our device data give an H20 node's host "
                             "memory, so set it to your nodes' figure")
    parser.add_argument("--device", default="H20", choices=sorted(DEVICES),
                        help="the accelerator (pivotrl.sim.catalog.DEVICES); default H20, the paper's (§8.1)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    if args.node_memory_gib is not None and not args.node_memory_gib > 0:
        print(f"error: --node-memory-gib must be > 0, got {args.node_memory_gib}", file=sys.stderr)
        return 2
    budget = None if args.node_memory_gib is None else int(args.node_memory_gib * GIB)
    try:
        cfg = load_config(args.config, args.overrides, for_cluster_only=True)
        report = check(cfg, node_budget_bytes=budget, device=args.device)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
