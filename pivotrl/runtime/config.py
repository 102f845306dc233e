"""Configuration of the ``torchrun launch/pivotrl.py`` pipeline (§8.1 setup, Table 4 allocations).

``PipelineConfig`` holds one dataclass per component, each a section of the YAML file: ``run``,
``cluster``, ``models``, ``data``, ``deployment`` (:class:`pivotrl.control.config.DeploymentConfig`),
``rollout`` and ``genrm`` (the engine and sampling settings of each inference role), ``reward``
(:class:`pivotrl.roles.reward.RewardConfig`), ``trainer`` (:class:`pivotrl.roles.trainer.TrainerConfig`)
and ``gps``. A ``*Section`` is the part of a component's config a user sets; the runtime completes it
with facts of the cluster (``engine_config``, ``gps_config``). ``load_config`` merges a YAML file and
``key=value`` overrides onto the structured schema (omegaconf), so an unknown key or a wrong type fails.

Validation has two levels. Structural (always, no I/O): keys, types, each section's ``__post_init__``
and the cross-section checks of ``PipelineConfig.__post_init__`` (tp against the node, the deployment
against the cluster, whole GRPO groups per training device). Runnable (``check_runnable``, reads
files): checkpoints (positions; heads against the role's tp), the data file, the reward function.
``load_config(..., for_cluster_only=True)`` skips the second level: the paper's configs
(``launch/configs/paper``) name checkpoints of a GPU cluster's file system.

Invariant: every error of this module is a ``ConfigError`` whose message names the dotted key(s) at
fault, first where there is one (``data.prompts_per_step: ...``), and says what is allowed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from pivotrl.control.config import DEPLOYMENT_KINDS, DeploymentConfig
from pivotrl.roles.data import MAX_ARITHMETIC_PROMPTS, NUM_HELDOUT, PromptDataset
from pivotrl.roles.engine_types import EngineSettings
from pivotrl.roles.reward import RewardConfig, score_choices
from pivotrl.roles.trainer import TrainerConfig
from pivotrl.gps.settings import GPSSettings

if typing.TYPE_CHECKING:
    from pivotrl.gps.config import GPSConfig
    from pivotrl.roles.engine import EngineConfig

__all__ = ["ClusterConfig", "ConfigError", "DataConfig", "EngineSection", "GPSSettings", "ModelsConfig",
           "PipelineConfig", "RunConfig", "WaitsConfig", "TINY", "TINY_MOE", "load_config", "load_prompts"]

TINY = "tiny"  # models.*: the embedded (shipped) checkpoints of pivotrl.roles.tiny.ensure_tiny_checkpoints()
TINY_MOE = "tiny-moe"  # models.genrm: the embedded (shipped) Qwen3-MoE GenRM of pivotrl.roles.tiny_moe.ensure_tiny_moe_genrm()
DATA_SUFFIXES = (".parquet", ".jsonl")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ConfigError(ValueError):
    """A config that cannot be used; the message starts with the dotted key at fault."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One run: its name, output folder, seed and length."""

    name: str = "default"  # run folder prefix: <out_dir>/<name>-<UTC time>-<random>/
    out_dir: str = "runs"  # folder under which run folders are created
    seed: int = 0  # seeds data order, sampling noise and model init
    num_steps: int = 3  # RL steps (each: rollout -> GenRM reward -> GRPO training)
    progress: bool = True  # console progress bar (one line per step when stdout is not a terminal)
    timeout_s: float = 1800.0  # seconds; the whole run aborts with a message after this
    write_sequences: bool = False  # trace every sequence (tokens, log-probs, versions, reward) in sequences.jsonl
    checkpoint_every: int = 0  # a checkpoint (policy, optimizer, data cursor) after every n-th step and the last; 0: none
    keep_checkpoints: int = 2  # the newest checkpoints kept in <run folder>/checkpoints
    # false: a new run; true: continue the newest <out_dir>/<name>-* run folder holding a checkpoint; a path: that
    # run folder (pivotrl/runtime/checkpoint.py). A job torchrun restarts (--max-restarts) resumes its own folder.
    resume: Any = False
    # the scheduler's and planner's throughput model of each role (§6.1, App. A): true: profiled on the role's
    # first engine and fitted (cached per model, engine config and device kind in fit_cache), then refitted from
    # the engines' reports; false: the built-in CPU prior throughout
    fit_engines: bool = True
    fit_cache: str | None = None  # folder of cached fits; null: $PIVOTRL_CACHE/fits (~/.cache/pivotrl/fits)
    # true: at start-up every device starts the engine of each inference role the deployment may place on it and
    # releases it (vLLM sleep mode on GPUs, in place on CPU), so no shift pays an engine start; the run's time
    # and tokens/s count from the first placement, the start-up is reported as startup_s
    prepare_engines: bool = True
    # true: at start-up the training devices build the trainer (FSDP set-up) and validate the initial policy (when
    # eval.every > 0), then free its parameters until the first step; false: both at the first step, inside it
    prepare_training: bool = True
    # quiet: the console shows the run folder, one line per step and the closing line; vLLM, NIXL, torch and
    # transformers output goes to <run folder>/logs/rank-<r>.log. info: that output on the console too; debug: and
    # vLLM's debug log (pivotrl/console.py)
    log_level: str = "quiet"

    def __post_init__(self) -> None:
        from pivotrl.console import LOG_LEVELS

        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        if not _NAME_RE.fullmatch(self.name):
            raise ConfigError(f"name: must match {_NAME_RE.pattern} (a folder name), got {self.name!r}")
        if not self.out_dir:
            raise ConfigError("out_dir: must be a non-empty path")
        if self.num_steps < 1:
            raise ConfigError(f"num_steps: must be >= 1, got {self.num_steps}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s: must be a positive finite number of seconds, got {self.timeout_s}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every: must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints: must be >= 1, got {self.keep_checkpoints}")
        if not (isinstance(self.resume, bool) or (isinstance(self.resume, str) and self.resume.strip())):
            raise ConfigError(f"resume: must be false, true or the path of a run folder, got {self.resume!r}")


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The devices of the job; torchrun's WORLD_SIZE must equal ``num_nodes * devices_per_node``."""

    num_nodes: int = 1  # torchrun --nnodes
    devices_per_node: int = 4  # torchrun --nproc_per_node (one worker process per device)
    # emulated devices of fixed capacity on CPU (pivotrl/runtime/pacing.py): the fraction of one core each rank's
    # device work may use; auto: cores / devices_per_node when there are more ranks than cores, else unpaced;
    # off: never paced; on GPUs a device is its own capacity and this is ignored
    device_share: Any = "auto"

    def __post_init__(self) -> None:
        for name in ("num_nodes", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        share = self.device_share
        if share not in ("auto", "off") and not (isinstance(share, (int, float)) and not isinstance(share, bool)
                                                 and 0 < share <= 1):
            raise ConfigError(f"device_share: must be auto, off or a fraction of one core in (0, 1], got {share!r}")

    def pacing_share(self) -> float | None:
        """The share each rank is paced to on CPU (None: unpaced)."""
        from pivotrl.runtime.pacing import auto_device_share

        if self.device_share == "off":
            return None
        if self.device_share == "auto":
            return auto_device_share(self.devices_per_node)
        return float(self.device_share)


@dataclass(kw_only=True, slots=True)
class ModelsConfig:
    """The policy and the GenRM: ``"tiny"`` (embedded checkpoints), ``"tiny-moe"`` (GenRM only: the embedded
    Qwen3-MoE GenRM) or an HF checkpoint folder."""

    policy: str = TINY  # "tiny", or a folder holding config.json and weights
    genrm: str = TINY  # "tiny", "tiny-moe", or a folder holding config.json and weights
    policy_tp: int = 1  # devices per rollout replica; divides cluster.devices_per_node
    genrm_tp: int = 1  # devices per GenRM replica (an MoE GenRM: its TP = EP degree); divides devices_per_node

    def __post_init__(self) -> None:
        for name in ("policy", "genrm"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: must be {TINY!r} or a checkpoint folder, got an empty string")
        if self.policy == TINY_MOE:
            raise ConfigError(f"policy: {TINY_MOE!r} is an embedded GenRM only; use {TINY!r} or a checkpoint folder")
        for name in ("policy_tp", "genrm_tp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The prompts and the GRPO batch of one step."""

    path: str | None = None  # a DAPO-Math-17k / AIME-2024-style .parquet or .jsonl; None: built-in arithmetic
    num_arithmetic_prompts: int = 64  # size of the built-in arithmetic set (used when path is None)
    prompts_per_step: int = 4  # prompts per RL step; a multiple of the training devices
    group_size: int = 4  # GRPO responses per prompt
    # natural: every sequence ends where the model stops (or at max_tokens); lognormal: a synthetic-length
    # throughput workload, each response's length drawn log-normal (the simulator's WorkloadConfig law: median,
    # sigma of log length, cut at rollout.max_tokens, a share of the log-variance common to a GRPO group) and
    # generated to exactly that length (ignore_eos), as vLLM's serving benchmarks do; judgements too when
    # genrm.output = free (a constrained GenRM ends where its constraint does). Rewards are computed as usual.
    lengths: str = "natural"
    response_median: float = 24.0  # tokens (lognormal)
    response_sigma: float = 0.8
    judgement_median: float = 12.0  # tokens (lognormal, genrm.output = free)
    judgement_sigma: float = 0.6
    length_group_share: float = 0.5  # share of log-variance common to a prompt's group (hard prompts run long)

    def __post_init__(self) -> None:
        if self.lengths not in ("natural", "lognormal"):
            raise ConfigError(f"lengths: must be natural or lognormal, got {self.lengths!r}")
        for name in ("response_median", "judgement_median"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{name}: must be a positive number of tokens, got {getattr(self, name)}")
        for name in ("response_sigma", "judgement_sigma"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"{name}: must be >= 0 (the spread of log length), got {getattr(self, name)}")
        if not 0 <= self.length_group_share <= 1:
            raise ConfigError(f"length_group_share: must be in [0, 1], got {self.length_group_share}")
        if self.path is not None and Path(self.path).suffix not in DATA_SUFFIXES:
            raise ConfigError(f"path: must end with one of {DATA_SUFFIXES} or be null, got {self.path!r}")
        if not 1 <= self.num_arithmetic_prompts <= MAX_ARITHMETIC_PROMPTS - NUM_HELDOUT:
            raise ConfigError(f"num_arithmetic_prompts: must be in [1, {MAX_ARITHMETIC_PROMPTS - NUM_HELDOUT}], "
                              f"got {self.num_arithmetic_prompts}")
        for name in ("prompts_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.path is None and self.prompts_per_step > self.num_arithmetic_prompts:
            raise ConfigError(f"prompts_per_step: must be <= the dataset size (num_arithmetic_prompts = "
                              f"{self.num_arithmetic_prompts}), got {self.prompts_per_step}")

    @property
    def seqs_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Validation (§8.7): greedy accuracy and avg@k of the policy on a held-out set."""

    every: int = 0  # validate the policy before step 0 and after every ``every``-th step (and the last); 0: never
    path: str | None = None  # held-out .parquet / .jsonl (e.g. AIME-2024); None: the held-out arithmetic split
    num_prompts: int = 32  # size of the held-out arithmetic split (used when path is None)
    k: int = 4  # sampled responses per prompt (avg@k); 0: greedy only
    temperature: float = 1.0  # of the sampled responses
    max_tokens: int | None = None  # response budget; None: rollout.max_tokens

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"every: must be >= 0 (0: no validation), got {self.every}")
        if self.path is not None and Path(self.path).suffix not in DATA_SUFFIXES:
            raise ConfigError(f"path: must end with one of {DATA_SUFFIXES} or be null, got {self.path!r}")
        if not 1 <= self.num_prompts <= NUM_HELDOUT:
            raise ConfigError(f"num_prompts: must be in [1, {NUM_HELDOUT}] (the held-out arithmetic split), "
                              f"got {self.num_prompts}")
        if self.k < 0:
            raise ConfigError(f"k: must be >= 0 (0: greedy only), got {self.k}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"temperature: must be a positive number, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens: must be >= 1 or null, got {self.max_tokens}")


@dataclass(kw_only=True, slots=True)
class EngineSection(EngineSettings):
    """One inference role (``rollout`` or ``genrm``): its engines' ``EngineSettings`` and how it samples."""

    max_tokens: int = 48  # generation budget of one sequence, tokens
    temperature: float = 1.0  # sampling temperature; 0: greedy
    output: Literal["free", "score", "regex"] = "free"  # what every sequence may be (vLLM structured outputs;
    # genrm only, rollout stays free): free text; score: exactly one grade "Score: 0/N" ... "Score: N/N" of
    # N = reward.score_scale (no reasoning); regex: a full match of output_regex
    # genrm only: the GenRM's prompt, a template with {question} and {response} (and optionally {scale}: the
    # score scale) or the path of a file holding one, rendered through the GenRM tokenizer's chat template when it
    # has one; "" = the built-in grading prompt (pivotrl.roles.reward.GENRM_TEMPLATE)
    prompt_template: str = ""
    output_regex: str = ""  # read only when output = regex: Python re syntax, ASCII classes, e.g. "[^\n]{0,200}\nScore: (10|[0-9])/10"

    def __post_init__(self) -> None:
        super(EngineSection, self).__post_init__()
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.max_model_len <= self.max_tokens:
            raise ConfigError(f"max_model_len: must exceed max_tokens = {self.max_tokens} (room for the prompt), "
                              f"got {self.max_model_len}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        _check_output(self.output, self.output_regex)

    def engine_config(self, *, model_path: str, tp: int, seed: int, score_scale: float | None = None,
                      expert_parallel: bool = False) -> EngineConfig:
        """The ``EngineConfig`` of one replica of this role; ``output = score`` needs ``score_scale``
        (``reward.score_scale``), whose integer grades become the engine's choices; ``expert_parallel``: an MoE
        model's experts spread whole over the tp ranks."""
        from pivotrl.roles.engine import EngineConfig

        choices: tuple[str, ...] = ()
        if self.output == "score":
            if score_scale is None:
                raise ValueError("engine_config: output = score needs score_scale (reward.score_scale)")
            choices = score_choices(score_scale)
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSettings)}
        return EngineConfig(**settings, model_path=model_path, tensor_parallel_size=tp, seed=seed,
                            expert_parallel=expert_parallel, structured=_STRUCTURED[self.output],
                            structured_choices=choices,
                            structured_regex=self.output_regex if self.output == "regex" else "")


_STRUCTURED = {"free": "free", "score": "choice", "regex": "regex"}  # EngineSection.output -> EngineConfig.structured


def _check_output(output: str, output_regex: str) -> None:
    if output not in _STRUCTURED:
        raise ConfigError(f"output: must be one of free, score, regex; got {output!r}")
    if output == "regex":
        from pivotrl.roles.structured import regex_dfa

        try:
            regex_dfa(output_regex)
        except ValueError as err:
            raise ConfigError(f"output_regex: {err}") from None


WANDB_MODES = ("off", "offline", "online")


@dataclass(kw_only=True, slots=True)
class WaitsConfig:
    """How long each wait of the job may last before it fails with a message naming what it waited for (seconds).

    Defaults fit the embedded default on two cores; a large checkpoint on a slow file system, or a GPU cluster
    whose engines take minutes to start, wants longer ``startup_s`` / ``collective_s`` / ``save_s``."""

    collective_s: float = 600.0  # any torch.distributed collective (process-group timeout: training, GPS, set-up)
    startup_s: float = 600.0  # each start-up phase: the engines' fits, the engines prepared on every device
    connect_s: float = 300.0  # a worker's first connection to the controller (its imports, GPS set-up)
    send_s: float = 30.0  # a message to a connected worker that stops taking messages
    save_s: float = 300.0  # the policy checkpoint written at the end of a run
    shutdown_s: float = 120.0  # every worker to stop after the run; a background GPS write to finish

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{f.name}: must be a positive finite number of seconds, got {value!r}")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Metrics where users look, beside ``metrics.jsonl`` (the same scalars, one point per step)."""

    tensorboard: bool = False  # <run folder>/tensorboard through torch.utils.tensorboard (needs ``tensorboard``)
    wandb: Any = "off"  # off | offline (<run folder>/wandb; `wandb sync` it later) | online (needs a login)
    wandb_project: str = "pivotrl"

    def __post_init__(self) -> None:
        if self.wandb is False or self.wandb == "False":  # YAML reads a bare `off` as false
            self.wandb = "off"
        if not isinstance(self.tensorboard, bool):
            raise ConfigError(f"tensorboard: must be true or false, got {self.tensorboard!r}")
        if self.wandb not in WANDB_MODES:
            raise ConfigError(f"wandb: must be one of {list(WANDB_MODES)}, got {self.wandb!r}")
        if not self.wandb_project or not isinstance(self.wandb_project, str):
            raise ConfigError(f"wandb_project: must be a non-empty name, got {self.wandb_project!r}")
        for enabled, module, key in ((self.tensorboard, "tensorboard", "tensorboard"),
                                     (self.wandb != "off", "wandb", "wandb")):
            if enabled and importlib.util.find_spec(module) is None:
                raise ConfigError(f"{key}: the {module} package is not installed; pip install {module} "
                                  f"(or pip install -e '.[logging]'), or set logging.{key}="
                                  f"{'false' if key == 'tensorboard' else 'off'}")


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """The whole pipeline; each field is one YAML section."""

    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    deployment: DeploymentConfig  # no default: deployment.kind must be chosen
    rollout: EngineSection = field(default_factory=EngineSection)
    genrm: EngineSection = field(default_factory=EngineSection)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # a pipeline's GPS crosses processes: nixl (UCX) or torch.distributed
    gps: GPSSettings = field(default_factory=lambda: GPSSettings(transport="nixl"))
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    waits: WaitsConfig = field(default_factory=WaitsConfig)

    def __post_init__(self) -> None:
        _check_tp(self)
        _check_deployment(self)
        _check_batch(self)
        _check_outputs(self)
        _check_temperature(self)
        _check_judge(self)
        _check_gps(self)

    @property
    def num_devices(self) -> int:
        return self.cluster.num_nodes * self.cluster.devices_per_node

    @property
    def num_training_devices(self) -> int:
        """The training set: the whole cluster when colocated, else ``deployment.training_devices``."""
        return self.num_devices if self.deployment.kind == "colocated" else self.deployment.training_devices

    def check_runnable(self) -> None:
        """Checks that read files (checkpoints: their positions, and their heads against the role's tp; the data
        file; the reward function); ``ConfigError`` if any fails."""
        for key, engine in (("policy", self.rollout), ("genrm", self.genrm)):
            _check_checkpoint(key, getattr(self.models, key), engine, "rollout" if key == "policy" else "genrm",
                              tp=getattr(self.models, f"{key}_tp"))
        if self.reward.function:
            from pivotrl.roles.reward import load_reward_function

            try:
                load_reward_function(self.reward.function)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if self.data.path is not None:
            load_prompts(self)
        if self.eval.every and self.eval.path is not None:
            load_eval_prompts(self)

    def to_yaml(self) -> str:
        """The resolved config as YAML (``load_config`` of this text gives an equal config)."""
        return OmegaConf.to_yaml(OmegaConf.create(_plain(dataclasses.asdict(self))))

    def gps_config(self) -> GPSConfig:
        """The ``GPSConfig`` of this cluster."""
        from pivotrl.gps.config import GPSConfig

        settings = {f.name: getattr(self.gps, f.name) for f in dataclasses.fields(GPSSettings)}
        return GPSConfig(**settings, num_nodes=self.cluster.num_nodes, devices_per_node=self.cluster.devices_per_node)


def load_config(path: str | Path, overrides: Sequence[str] = (), *, for_cluster_only: bool = False) -> PipelineConfig:
    """The config in YAML file ``path`` with ``key=value`` ``overrides`` applied, validated.

    ``for_cluster_only``: validate the structure only (no file reads): for configs of a GPU cluster whose
    checkpoints and data are not on this machine."""
    merged = OmegaConf.structured(PipelineConfig)
    given: set[str] = set()  # the dotted keys the file and the overrides set
    for key, value in _leaves(OmegaConf.to_container(_read_yaml(Path(path)), resolve=False)):
        given.add(".".join(map(str, key)))
        _merge(merged, OmegaConf.create(_nest(key, value)), where=".".join(map(str, key)))
    for override in overrides:
        given.add(override.partition("=")[0].strip())
        _merge(merged, _parse_override(override), where=override.partition("=")[0].strip())
    _derive(merged, given)
    cfg = _build(merged)
    if not for_cluster_only:
        cfg.check_runnable()
    return cfg


def _derive(merged: DictConfig, given: set[str]) -> None:
    """Values that follow from others unless the config sets them: ``trainer.temperature`` is the rollouts'
    sampling temperature (1.0 for greedy rollouts). A value that is set is checked instead
    (``PipelineConfig.__post_init__``)."""
    if not given & {"trainer", "trainer.temperature"}:
        merged.trainer.temperature = float(merged.rollout.temperature or 1.0)


def load_prompts(cfg: PipelineConfig) -> PromptDataset:
    """The deduplicated prompts of ``cfg.data``; ``ConfigError`` naming ``data.path`` if unusable."""
    data = cfg.data
    if data.path is None:
        return PromptDataset.arithmetic(data.num_arithmetic_prompts, seed=cfg.run.seed, split="train")
    path = Path(data.path)
    if not path.is_file():
        raise ConfigError(f"data.path: no such file: {str(path)!r} (give a .parquet or .jsonl file, or null for the "
                          "built-in arithmetic set)")
    try:
        dataset = PromptDataset.from_file(path)
    except Exception as err:  # noqa: BLE001 (any failure to read the file is the file's fault; say so)
        raise ConfigError(f"data.path: {str(path)!r} cannot be used: {err}") from None
    if data.prompts_per_step > len(dataset):
        raise ConfigError(f"data.prompts_per_step: must be <= the dataset size ({len(dataset)} distinct prompts "
                          f"in {str(path)!r}), got {data.prompts_per_step}")
    return dataset


def load_eval_prompts(cfg: PipelineConfig) -> PromptDataset:
    """The held-out validation set of ``cfg.eval``; ``ConfigError`` naming ``eval.path`` if unusable."""
    if cfg.eval.path is None:
        from pivotrl.roles.data import heldout_arithmetic

        return heldout_arithmetic(cfg.eval.num_prompts)
    path = Path(cfg.eval.path)
    if not path.is_file():
        raise ConfigError(f"eval.path: no such file: {str(path)!r} (give a .parquet or .jsonl file, or null for "
                          "the held-out arithmetic split)")
    try:
        return PromptDataset.from_file(path)
    except Exception as err:  # noqa: BLE001 (any failure to read the file is the file's fault; say so)
        raise ConfigError(f"eval.path: {str(path)!r} cannot be used: {err}") from None


# ---------------------------------------------------------------- cross-section checks (no I/O)
def _check_tp(cfg: PipelineConfig) -> None:
    per_node = cfg.cluster.devices_per_node
    for key in ("policy_tp", "genrm_tp"):
        tp = getattr(cfg.models, key)
        if per_node % tp:
            raise ConfigError(f"models.{key}: must divide cluster.devices_per_node = {per_node} (a replica lives "
                              f"on one node), got {tp}")


def _check_deployment(cfg: PipelineConfig) -> None:
    dep, n = cfg.deployment, cfg.num_devices
    try:
        dep.check(n, cfg.models.policy_tp, cfg.models.genrm_tp)
    except ValueError as err:
        message = re.sub(r"(?<![.\w])(rollout_devices|reward_devices|training_devices)\b", r"deployment.\1", str(err))
        message = re.sub(r"^deployment: (?=deployment\.)", "", message)
        raise ConfigError(f"{message} (cluster: {n} devices = cluster.num_nodes {cfg.cluster.num_nodes} x "
                          f"cluster.devices_per_node {cfg.cluster.devices_per_node}; models.policy_tp "
                          f"{cfg.models.policy_tp}, models.genrm_tp {cfg.models.genrm_tp})") from None
    if dep.migration != "recompute":
        raise ConfigError(f"deployment.migration: {dep.migration!r} is modelled by the simulator only (python -m "
                          f"pivotrl.sim.experiments migration); the runtime's vLLM engines re-prefill a migrated "
                          f"sequence: allowed here: 'recompute'")
    if dep.kind == "shiftable":
        from pivotrl.planner import STRATEGIES, make_strategy  # the planner registry (pure)

        if dep.strategy in STRATEGIES:
            try:
                make_strategy(dep.strategy, **dep.strategy_cfg)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"deployment.strategy_cfg: {err}") from None


def _check_batch(cfg: PipelineConfig) -> None:
    num_training = cfg.num_training_devices
    if cfg.data.prompts_per_step % num_training:
        where = "the whole cluster (colocated)" if cfg.deployment.kind == "colocated" else "deployment.training_devices"
        raise ConfigError(f"data.prompts_per_step: must be a multiple of the {num_training} training devices "
                          f"({where}) so that each training rank gets whole GRPO groups, got "
                          f"{cfg.data.prompts_per_step}")


def _check_temperature(cfg: PipelineConfig) -> None:
    """The trainer's log-probs must be taken at the temperature the rollouts were sampled at (greedy: 1)."""
    sampled_at = cfg.rollout.temperature or 1.0
    if cfg.trainer.temperature != sampled_at:
        raise ConfigError(f"trainer.temperature: must equal the rollouts' sampling temperature {sampled_at} "
                          f"(rollout.temperature; 1.0 for greedy rollouts), got {cfg.trainer.temperature}: the "
                          "policy ratio and the behaviour log-probs are taken at that temperature")


def _check_judge(cfg: PipelineConfig) -> None:
    """Only the GenRM has a judge prompt, and its template is valid (a file is read here)."""
    from pivotrl.roles.reward import JudgeTemplate

    if cfg.rollout.prompt_template:
        raise ConfigError("rollout.prompt_template: only the GenRM has a prompt template (genrm.prompt_template); "
                          "the policy's prompts come from the data")
    try:
        JudgeTemplate.load(cfg.genrm.prompt_template)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_gps(cfg: PipelineConfig) -> None:
    if cfg.gps.transport not in ("nixl", "torch"):
        raise ConfigError(f"gps.transport: must be 'nixl' or 'torch' (a pipeline's ranks are processes), got "
                          f"{cfg.gps.transport!r}")


def _check_outputs(cfg: PipelineConfig) -> None:
    """Only the GenRM's output is constrained; ``score`` needs integer grades that fit in ``genrm.max_tokens``."""
    if cfg.rollout.output != "free":
        raise ConfigError(f"rollout.output: must be 'free' (the policy's responses are never constrained; "
                          f"genrm.output constrains the GenRM's judgements), got {cfg.rollout.output!r}")
    if cfg.genrm.output != "score":
        return
    try:
        longest = max(score_choices(cfg.reward.score_scale), key=len)
    except ValueError as err:
        raise ConfigError(f"reward.{err} (genrm.output = score writes the grades Score: 0/N ... Score: N/N)") from None
    if cfg.genrm.max_tokens < len(longest) + 1:  # a token holds >= 1 character of an ASCII grade, + end of sequence
        raise ConfigError(f"genrm.max_tokens: must be >= {len(longest) + 1} with genrm.output = score (the grade "
                          f"{longest!r} is {len(longest)} characters, then the end-of-sequence token), "
                          f"got {cfg.genrm.max_tokens}")


def _check_checkpoint(key: str, model: str, engine: EngineSection, engine_key: str, *, tp: int) -> None:
    """A checkpoint folder exists, holds config.json, has room for ``max_model_len`` positions, and its heads,
    KV heads and (padded) vocabulary split into ``tp`` shards as vLLM splits them."""
    if model in (TINY, TINY_MOE):  # the MoE GenRM has the dense GenRM's positions and heads (pivotrl.roles.tiny_moe)
        from pivotrl.roles.tiny import TinyBuildSpec

        spec = TinyBuildSpec()
        shape = spec.policy if key == "policy" else spec.genrm
        hf: dict[str, Any] = {"max_position_embeddings": shape.max_position_embeddings,
                              "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
                              "hidden_size": shape.hidden_size, "vocab_size": spec.vocab_size}
    else:
        config_json = Path(model) / "config.json"
        if not config_json.is_file():
            raise ConfigError(f"models.{key}: must be {TINY!r} or an HF checkpoint folder holding config.json; "
                              f"{str(config_json)!r} does not exist")
        try:
            hf = json.loads(config_json.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"models.{key}: cannot read {str(config_json)!r}: {err}") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"models.{key}: cannot read {str(config_json)!r}: not a JSON object")
    max_positions = hf.get("max_position_embeddings")
    if isinstance(max_positions, int) and engine.max_model_len > max_positions:
        raise ConfigError(f"{engine_key}.max_model_len: must be <= {max_positions} (max_position_embeddings of "
                          f"models.{key}), got {engine.max_model_len}")
    if tp > 1:
        _check_tp_split(key, hf, tp)


def _check_tp_split(key: str, hf: dict[str, Any], tp: int) -> None:
    from types import SimpleNamespace

    from pivotrl.gps.convert import ModelShape

    try:
        shape = ModelShape.from_hf_config(SimpleNamespace(**{"num_key_value_heads": None, "head_dim": None, **hf}))
        shape.check_tp(tp)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError) as err:
        raise ConfigError(f"models.{key}_tp: {tp} does not split models.{key} into tensor-parallel shards: "
                          f"{err}") from None


# ---------------------------------------------------------------- YAML + overrides -> dataclasses
def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r}: no such file")
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(f"config file {str(path)!r}: not valid YAML: {detail}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {str(path)!r}: must be a mapping of sections, got a list")
    return loaded


def _parse_override(override: str) -> DictConfig:
    key, eq, _ = override.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"override {override!r}: expected key=value, e.g. run.num_steps=5")
    try:
        return OmegaConf.from_dotlist([override])
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(f"{key.strip()}: override {override!r} cannot be parsed: {_first_line(err)}") from None


def _leaves(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """(key path, value) of every leaf of a nested dict; an empty dict is a leaf."""
    if isinstance(tree, dict) and tree:
        return [leaf for key, value in tree.items() for leaf in _leaves(value, (*prefix, key))]
    return [(prefix, tree)]


def _nest(key: tuple[Any, ...], value: Any) -> Any:
    for part in reversed(key):
        value = {part: value}
    return value


def _merge(base: DictConfig, extra: DictConfig, *, where: str) -> None:
    """Merge ``extra`` into ``base`` in place; one YAML leaf or override at a time, so an error names its key."""
    try:
        base.merge_with(extra)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, where) from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # omegaconf's own, e.g. a dict onto a list
        raise ConfigError(f"{where}: {_first_line(err)}") from None


def _build(merged: DictConfig) -> PipelineConfig:
    """Each section instantiated by OmegaConf (``to_object``: its dataclass, ``__post_init__`` included); a
    ``ValueError`` of a section's validation becomes a ``ConfigError`` naming the section, then the
    cross-section checks of ``PipelineConfig.__post_init__``."""
    hints, sections = typing.get_type_hints(PipelineConfig), {}
    for f in dataclasses.fields(PipelineConfig):
        try:
            sections[f.name] = OmegaConf.to_object(merged[f.name])
        except OmegaConfBaseException as err:
            raise _omegaconf_error(err, f.name) from None
        except ValueError as err:
            raise _section_error(f.name, hints[f.name], err) from None
    return PipelineConfig(**sections)


def _section_error(key: str, cls: type, err: ValueError) -> ConfigError:
    """A section's own validation error, prefixed with the section's key unless it names it already."""
    message = str(err)
    if message.startswith((f"{key}.", f"{key}:")):
        return ConfigError(message)
    if any(re.match(rf"{f.name}\b", message) for f in dataclasses.fields(cls)):
        return ConfigError(f"{key}.{message}")
    return ConfigError(f"{key}: {message}")


def _omegaconf_error(err: OmegaConfBaseException, where: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError) and key:
        return ConfigError(_unknown_key_message(key))
    if isinstance(err, MissingMandatoryValue) and key in ("deployment", "deployment.kind"):
        return ConfigError(f"deployment.kind: missing; set it to one of {list(DEPLOYMENT_KINDS)}")
    if isinstance(err, MissingMandatoryValue) and key:
        return ConfigError(f"{key}: missing; it has no default and must be set")
    return ConfigError(f"{key or where}: {_first_line(err)}")


def _unknown_key_message(key: str) -> str:
    parent, _, _ = key.rpartition(".")
    cls: Any = PipelineConfig
    for part in filter(None, parent.split(".")):
        cls = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
    valid = ", ".join(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else "(none)"
    what = f"valid keys of {parent}" if parent else "valid sections"
    return f"{key}: unknown key; {what}: {valid}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _plain(value: Any) -> Any:
    """Tuples as lists (YAML has no tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
