"""The pipeline config: the default and the paper's configs load; every bad input is a ConfigError naming its key."""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.data import dapo_row, write_rows
from pivotrl.runtime.config import (
    ConfigError, DataConfig, EngineSection, PipelineConfig, load_config, load_prompts,
)

LAUNCH = Path(__file__).resolve().parents[2] / "launch" / "configs"
DEFAULT = LAUNCH / "default.yaml"
PAPER = sorted((LAUNCH / "paper").glob("*.yaml"))
# Table 4: (GPUs, PivotRL training set, policy tp, GenRM tp) per model group.
TABLE4 = {
    "qwen2.5-1.5b_glm-z1-9b": (32, 16, 1, 1),
    "qwen2.5-7b_qwen3-30b-a3b": (32, 8, 1, 4),
    "qwen2.5-32b_qwen3-30b-a3b": (64, 32, 4, 4),
    "qwen2.5-72b_qwen3.5-122b-a10b": (128, 64, 8, 8),
}


def _dapo_parquet(path: Path, num_distinct: int, num_repeats: int) -> Path:
    rows = [dapo_row(f"What is {i} + {i}?", str(2 * i), index=f"id-{i}", data_source="math_dapo")
            for i in range(num_distinct)]
    return write_rows(path, [row for _ in range(num_repeats) for row in rows])


def test_default_loads_and_validates() -> None:
    cfg = load_config(DEFAULT, [])
    assert cfg.num_devices == 4 and cfg.cluster.num_nodes == 1
    assert cfg.deployment.kind == "shiftable" and cfg.deployment.strategy == "pivotrl"
    assert cfg.num_training_devices == 2 and cfg.deployment.staleness == 1
    assert cfg.models.policy == "tiny" and cfg.models.genrm == "tiny"
    assert cfg.run.num_steps == 8 and cfg.rollout.max_tokens == 48 and cfg.genrm.max_tokens == 24
    assert cfg.trainer.betas == (0.9, 0.999)
    assert cfg.data.prompts_per_step % cfg.num_training_devices == 0


def test_overrides_apply() -> None:
    cfg = load_config(DEFAULT, ["deployment.kind=disaggregated", "deployment.rollout_devices=1",
                                "deployment.reward_devices=1", "deployment.training_devices=2",
                                "run.num_steps=5", "trainer.lr=3e-6", "deployment.strategy_cfg.horizon_s=7.5"])
    assert cfg.deployment.kind == "disaggregated"
    assert (cfg.deployment.rollout_devices, cfg.deployment.reward_devices) == (1, 1)
    assert cfg.run.num_steps == 5 and cfg.trainer.lr == pytest.approx(3e-6)
    assert cfg.deployment.strategy_cfg == {"horizon_s": 7.5}


@pytest.mark.parametrize("rollout, expected", [("0.7", 0.7), ("0", 1.0), ("1.3", 1.3)])
def test_the_trainer_temperature_follows_the_rollouts_unless_set(rollout: str, expected: float) -> None:
    cfg = load_config(DEFAULT, [f"rollout.temperature={rollout}"])
    assert cfg.trainer.temperature == expected
    assert load_config(DEFAULT, [f"rollout.temperature={rollout}", f"trainer.temperature={expected}"]
                       ).trainer.temperature == expected


def test_waits_reach_the_workers() -> None:
    from pivotrl.roles.tiny import ensure_tiny_checkpoints
    from pivotrl.runtime.pipeline import _worker_spec

    cfg = load_config(DEFAULT, ["waits.startup_s=7", "waits.save_s=8", "waits.shutdown_s=9"])
    assert (cfg.waits.startup_s, cfg.waits.save_s, cfg.waits.shutdown_s, cfg.waits.collective_s) == (7, 8, 9, 600)
    tiny = ensure_tiny_checkpoints()
    assert _worker_spec(cfg, 0, tiny.policy_path, tiny.genrm_path, (2, 3)).write_timeout_s == 9


def test_colocated_trains_on_the_whole_cluster() -> None:
    cfg = load_config(DEFAULT, ["deployment.kind=colocated"])
    assert cfg.num_training_devices == 4
    with pytest.raises(ConfigError, match=r"data\.prompts_per_step"):
        load_config(DEFAULT, ["deployment.kind=colocated", "data.prompts_per_step=2"])


def test_dapo_parquet_loads_deduplicated(tmp_path: Path) -> None:
    path = _dapo_parquet(tmp_path / "dapo.parquet", num_distinct=10, num_repeats=3)
    cfg = load_config(DEFAULT, [f"data.path={path}"])
    assert cfg.data.path == str(path)
    prompts = load_prompts(cfg)
    assert len(prompts) == 10 and prompts.num_rows_read == 30 and prompts.num_duplicates == 20
    assert [p.ground_truth for p in prompts] == [str(2 * i) for i in range(10)]


def test_jsonl_loads(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": f"{i} + 1?", "answer": str(i + 1)} for i in range(4)] * 2)
    cfg = load_config(DEFAULT, [f"data.path={path}", "data.prompts_per_step=4"])
    assert len(load_prompts(cfg)) == 4


def test_parquet_without_reward_model_names_the_column(tmp_path: Path) -> None:
    rows = [{k: v for k, v in dapo_row(f"q{i}", "1", index=str(i)).items() if k != "reward_model"} for i in range(8)]
    path = write_rows(tmp_path / "broken.parquet", rows)
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, [f"data.path={path}"])
    assert str(err.value).startswith("data.path:") and "reward_model" in str(err.value)


def test_prompts_per_step_larger_than_the_file(tmp_path: Path) -> None:
    path = _dapo_parquet(tmp_path / "small.parquet", num_distinct=2, num_repeats=5)
    with pytest.raises(ConfigError, match=r"^data\.prompts_per_step: .*2 distinct prompts"):
        load_config(DEFAULT, [f"data.path={path}"])


BAD = [
    (["run.nmae=x"], "run.nmae", "valid keys of run: name, out_dir"),
    (["foo.bar=1"], "foo", "valid sections: run, cluster"),
    (["deployment.foo=1"], "deployment.foo", "valid keys of deployment"),
    (["run.num_steps=abc"], "run.num_steps", ""),
    (["run.num_steps=1.5"], "run.num_steps", ""),
    (["run.num_steps=0"], "run.num_steps", ">= 1"),
    (["run.progress=maybe"], "run.progress", ""),
    (["run.name=a/b"], "run.name", "folder name"),
    (["run.timeout_s=0"], "run.timeout_s", ""),
    (["cluster.devices_per_node=0"], "cluster.devices_per_node", ">= 1"),
    (["models.policy_tp=3"], "models.policy_tp", "divide cluster.devices_per_node"),
    (["models.genrm_tp=0"], "models.genrm_tp", ">= 1"),
    (["models.genrm=/no/such/folder"], "models.genrm", "config.json"),
    (["models.policy=tiny-moe"], "models.policy", "GenRM only"),
    (["deployment.training_devices=5"], "deployment.training_devices", "[1, 4]"),
    (["deployment.kind=disaggregated"], "deployment.rollout_devices", "= 4"),
    (["deployment.kind=bogus"], "deployment.kind", "shiftable"),
    (["deployment.staleness=-1"], "deployment.staleness", ">= 0"),
    (["deployment.strategy=nope"], "deployment.strategy", "pivotrl"),
    (["deployment.strategy_cfg.bogus=1"], "deployment.strategy_cfg", "horizon_s"),
    (["deployment.tick_s=5"], "deployment.tick_s", "max_tick_s"),
    (["data.path=/no/such/file.parquet"], "data.path", "no such file"),
    (["data.path=prompts.csv"], "data.path", ".parquet"),
    (["data.prompts_per_step=3"], "data.prompts_per_step", "multiple of the 2 training devices"),
    (["data.prompts_per_step=18"], "data.prompts_per_step", "dataset size"),
    (["data.num_arithmetic_prompts=0"], "data.num_arithmetic_prompts", ""),
    (["rollout.max_tokens=2000"], "rollout.max_model_len", "exceed max_tokens"),
    (["rollout.max_model_len=5000", "rollout.kv_cache_bytes=null"], "rollout.max_model_len", "4096"),
    (["genrm.temperature=-1"], "genrm.temperature", ">= 0"),
    (["genrm.dtype=int8"], "genrm.dtype", "float32"),
    (["rollout.output=score"], "rollout.output", "must be 'free'"),
    (["genrm.output=json"], "genrm.output", "expected one of"),
    (["genrm.output_regex=''"], "genrm.output_regex", "non-empty"),
    (["genrm.output=regex", "genrm.output_regex=a{2,1}"], "genrm.output_regex", "not a valid regular expression"),
    (["genrm.output=regex", "genrm.output_regex=^Score"], "genrm.output_regex", "anchors"),
    (["genrm.output=score", "reward.score_scale=2.5"], "reward.score_scale", "integer"),
    (["genrm.output=score", "genrm.max_tokens=12"], "genrm.max_tokens", ">= 13"),
    (["reward.on_unparsed=x"], "reward.on_unparsed", "verifiable_only"),
    (["reward.tail_chars=0"], "reward.tail_chars", ">= 1"),
    (["trainer.lr=-1"], "trainer.lr", ">= 0"),
    (["trainer.betas=[1,2,3]"], "trainer.betas", ""),
    (["trainer.dtype=float16"], "trainer.dtype", "bfloat16"),
    (["rollout.temperature=0.7", "trainer.temperature=1.0"], "trainer.temperature", "rollout.temperature"),
    (["waits.save_s=0"], "waits.save_s", "positive finite"),
    (["waits.startup_s=.inf"], "waits.startup_s", "positive finite"),
    (["waits.collective_s=soon"], "waits.collective_s", ""),
    (["waits.forever=1"], "waits.forever", "collective_s"),
    (["trainer.temperature=0"], "trainer.temperature", "> 0"),
    (["trainer.behaviour_weight_cap=0.5"], "trainer.behaviour_weight_cap", ">= 1"),
    (["eval.every=-1"], "eval.every", ">= 0"),
    (["eval.k=-2"], "eval.k", ">= 0"),
    (["eval.path=held.csv"], "eval.path", ".parquet"),
    (["eval.path=/no/such/aime.parquet"], "eval.path", "no such file"),
    (["eval.temperature=0"], "eval.temperature", "positive"),
    (["gps.transport=local"], "gps.transport", "nixl"),
    (["deployment.rebalance=maybe"], "deployment.rebalance", "bool"),
    (["deployment.reprefill_horizon_s=-1"], "deployment.reprefill_horizon_s", "finite number of seconds > 0"),
    (["deployment.reprefill_horizon_s=soon"], "deployment.reprefill_horizon_s", "Float"),
    (["deployment.min_gain=1"], "deployment.min_gain", "fraction >= 0 and < 1"),
    (["deployment.min_gain=some"], "deployment.min_gain", "Float"),
    (["deployment.migration=copy"], "deployment.migration", "recompute, kv_transfer"),
    (["deployment.migration=kv_transfer"], "deployment.migration", "allowed here: 'recompute'"),
    (["run=3"], "run", ""),
    (["run"], "run", "key=value"),
    (["run.name=${nowhere}"], "run.name", ""),
]


@pytest.mark.parametrize(("overrides", "key", "allowed"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_names_its_key(overrides: list[str], key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, overrides)
    message = str(err.value)
    assert key in message, message
    assert allowed in message, message


def test_the_embedded_moe_genrm_is_accepted_where_tiny_is() -> None:
    cfg = load_config(DEFAULT, ["models.genrm=tiny-moe"])
    assert cfg.models.genrm == "tiny-moe" and cfg.models.policy == "tiny"
    with pytest.raises(ConfigError, match=r"^genrm\.max_model_len: .*4096"):
        load_config(DEFAULT, ["models.genrm=tiny-moe", "genrm.max_model_len=5000"])


def test_model_names_resolve_to_the_embedded_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the launcher loads for ``models.*``: tiny-moe is the MoE GenRM's folder, tiny the dense ones."""
    import pivotrl.roles.tiny as tiny
    import pivotrl.roles.tiny_moe as tiny_moe
    from pivotrl.runtime.pipeline import embedded_checkpoints

    dense = tiny.TinyCheckpoints(policy_path=tmp_path / "policy", genrm_path=tmp_path / "genrm")
    monkeypatch.setattr(tiny, "ensure_tiny_checkpoints", lambda: dense)
    monkeypatch.setattr(tiny_moe, "ensure_tiny_moe_genrm", lambda: tmp_path / "moe")
    assert embedded_checkpoints(("tiny", "tiny-moe")) == (dense.policy_path, tmp_path / "moe")
    assert embedded_checkpoints(("tiny", "tiny")) == (dense.policy_path, dense.genrm_path)
    assert embedded_checkpoints(("/ckpt/policy", "tiny-moe")) == (Path("/ckpt/policy"), tmp_path / "moe")


def test_checkpoint_folder_positions(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    with pytest.raises(ConfigError, match=r"^rollout\.max_model_len: .*512"):
        load_config(DEFAULT, [f"models.policy={tmp_path}"])
    cfg = load_config(DEFAULT, [f"models.policy={tmp_path}", "rollout.max_model_len=512"])
    assert cfg.models.policy == str(tmp_path)


def test_tp_must_split_the_checkpoint_as_vllm_does(tmp_path: Path) -> None:
    """tp > 1 runs here (a replica over tp devices); the checkpoint's heads, KV heads and padded vocabulary are
    checked against it at start, in one line naming the key (the embedded models: 4 heads, 2 KV heads)."""
    assert load_config(DEFAULT, ["models.policy_tp=2", "models.genrm_tp=4"]).models.genrm_tp == 4
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "num_attention_heads": 6,
                                                      "num_key_value_heads": 2, "hidden_size": 384,
                                                      "vocab_size": 1000}))
    with pytest.raises(ConfigError, match=r"^models\.policy_tp: 4 does not split models\.policy .*num_heads=6"):
        load_config(DEFAULT, [f"models.policy={tmp_path}", "models.policy_tp=4"])
    assert load_config(DEFAULT, [f"models.policy={tmp_path}", "models.policy_tp=2"]).models.policy_tp == 2
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))  # no heads to split
    with pytest.raises(ConfigError, match=r"^models\.policy_tp: 2 does not split models\.policy"):
        load_config(DEFAULT, [f"models.policy={tmp_path}", "models.policy_tp=2"])


def test_yaml_file_errors(tmp_path: Path) -> None:
    cases = {
        "missing.yaml": None, "list.yaml": "- a\n- b\n", "broken.yaml": "run: [\n",
        "nokind.yaml": "run:\n  seed: 1\n", "unknown.yaml": "deployment:\n  kind: shiftable\nrun:\n  sead: 1\n",
    }
    expected = {"missing.yaml": "no such file", "list.yaml": "mapping", "broken.yaml": "not valid YAML",
                "nokind.yaml": "deployment.kind: missing", "unknown.yaml": "run.sead: unknown key"}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected[name])):
            load_config(tmp_path / name, [])


def test_yaml_loads_safely(tmp_path: Path) -> None:
    """A config file cannot run code: python tags are refused, nothing is constructed."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.yaml").write_text(
        f"deployment:\n  kind: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "evil.yaml", [])
    assert not marker.exists()


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT, ["deployment.strategy_cfg.horizon_s=5.0", "data.group_size=2"])
    (tmp_path / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "resolved.yaml", []) == cfg


def test_interpolation_is_resolved(tmp_path: Path) -> None:
    (tmp_path / "i.yaml").write_text(DEFAULT.read_text() + "\n")
    cfg = load_config(tmp_path / "i.yaml", ["run.name=seed${run.seed}"])
    assert cfg.run.name == "seed0" and "seed0" in cfg.to_yaml()


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_configs_validate_as_runnable_pipelines(path: Path, tmp_path: Path) -> None:
    """With checkpoint folders of the named models' shapes (their config.json facts from the catalog) and a data
    file, each paper config passes every check the launcher runs, tp > 1 included (the GenRM's 4 devices a
    replica, the larger policies' 4)."""
    from pivotrl.gps.synthetic import catalog_facts

    cfg = load_config(path, [], for_cluster_only=True)
    overrides = []
    for key in ("policy", "genrm"):
        facts = catalog_facts(getattr(cfg.models, key))
        folder = tmp_path / key
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "num_attention_heads": facts.num_heads, "num_key_value_heads": facts.num_kv_heads,
            "head_dim": facts.head_dim, "hidden_size": facts.hidden_size, "vocab_size": facts.vocab_size,
            "num_experts": facts.num_experts, "max_position_embeddings": 131072}))  # positions: not in the catalog
        overrides.append(f"models.{key}={folder}")
    rows = [dapo_row(f"What is {i} + {i}?", str(2 * i), index=str(i)) for i in range(cfg.data.prompts_per_step)]
    overrides.append(f"data.path={write_rows(tmp_path / 'dapo.parquet', rows)}")
    runnable = load_config(path, overrides)
    assert (runnable.models.policy_tp, runnable.models.genrm_tp) == (cfg.models.policy_tp, cfg.models.genrm_tp)


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_configs_validate_for_the_cluster_only(path: Path) -> None:
    num_devices, training, policy_tp, genrm_tp = TABLE4[path.stem]
    cfg = load_config(path, [], for_cluster_only=True)
    assert (cfg.num_devices, cfg.num_training_devices) == (num_devices, training)
    assert (cfg.models.policy_tp, cfg.models.genrm_tp) == (policy_tp, genrm_tp)
    assert cfg.cluster.devices_per_node == 8 and cfg.deployment.kind == "shiftable"
    assert cfg.deployment.staleness == 2
    with pytest.raises(ConfigError, match=r"^models\.(policy|genrm)"):
        load_config(path, [])  # a placeholder checkpoint (a hub name, not a folder): named at start
    baselines = [re.match(r"^#\s+(colocated|disaggregated|rr_colocated):\s+(.*)$", line)
                 for line in path.read_text().splitlines()]
    baselines = [m for m in baselines if m]
    assert sorted(m.group(1) for m in baselines) == ["colocated", "disaggregated", "rr_colocated"]
    for m in baselines:
        alt = load_config(path, shlex.split(m.group(2)), for_cluster_only=True)
        assert alt.deployment.kind == m.group(1) and alt.num_devices == num_devices


def test_table4_baselines() -> None:
    """The comment blocks hold Table 4's colocated / disaggregated / rr_colocated allocations."""
    expected = {"qwen2.5-1.5b_glm-z1-9b": ((8, 8, 16), (16, 16)), "qwen2.5-7b_qwen3-30b-a3b": ((12, 12, 8), (24, 8)),
                "qwen2.5-32b_qwen3-30b-a3b": ((16, 16, 32), (32, 32)),
                "qwen2.5-72b_qwen3.5-122b-a10b": ((32, 32, 64), (64, 64))}
    assert sorted(expected) == sorted(p.stem for p in PAPER)
    for path in PAPER:
        text = path.read_text()
        (ro, rm, tr), (shared, rr_tr) = expected[path.stem]
        dis = re.search(r"disaggregated:\s+(.*)", text)
        rr = re.search(r"rr_colocated:\s+(.*)", text)
        assert dis and rr
        d = load_config(path, shlex.split(dis.group(1)), for_cluster_only=True).deployment
        assert (d.rollout_devices, d.reward_devices, d.training_devices) == (ro, rm, tr)
        r = load_config(path, shlex.split(rr.group(1)), for_cluster_only=True).deployment
        assert (r.rollout_devices, r.training_devices) == (shared, rr_tr)


def test_for_cluster_only_skips_files_but_not_structure() -> None:
    cfg = load_config(DEFAULT, ["data.path=/cluster/dapo.parquet", "models.policy=/cluster/policy",
                                "models.policy_tp=2"], for_cluster_only=True)
    assert cfg.models.policy_tp == 2
    with pytest.raises(ConfigError, match=r"models\.policy_tp"):
        load_config(DEFAULT, ["models.policy_tp=3"], for_cluster_only=True)


def test_genrm_output_becomes_the_engine_constraint() -> None:
    from pivotrl.roles.reward import parse_score, score_choices

    default = load_config(DEFAULT, [])
    assert default.genrm.output == "regex" and default.rollout.output == "free"
    dfa = default.genrm.engine_config(model_path="m", tp=1, seed=0, score_scale=10.0).output_dfa
    assert dfa is not None and dfa.accepts("235 vs 240.\nScore: 0/10") and not dfa.accepts("235 vs 240.")
    assert parse_score("235 vs 240.\nScore: 0/10").value == 0.0  # what the embedded GenRM writes parses
    cfg = load_config(DEFAULT, ["genrm.output=score"])
    genrm = cfg.genrm.engine_config(model_path="m", tp=1, seed=0, score_scale=cfg.reward.score_scale)
    assert genrm.structured == "choice" and genrm.structured_choices == score_choices(10.0)
    assert [parse_score(c).value for c in genrm.structured_choices] == pytest.approx([i / 10 for i in range(11)])
    assert cfg.rollout.engine_config(model_path="m", tp=1, seed=0).structured == "free"
    with pytest.raises(ValueError, match="score_scale"):
        cfg.genrm.engine_config(model_path="m", tp=1, seed=0)
    cfg = load_config(DEFAULT, ["genrm.output=regex", r'genrm.output_regex="[a-z ]{1,9}\nScore: (10|[0-9])/10"'])
    genrm = cfg.genrm.engine_config(model_path="m", tp=1, seed=0, score_scale=cfg.reward.score_scale)
    assert genrm.structured == "regex" and genrm.output_dfa is not None and genrm.output_dfa.accepts("ok\nScore: 7/10")
    free = load_config(DEFAULT, ["genrm.output=free", "reward.score_scale=2.5", "genrm.max_tokens=3"])
    assert free.genrm.engine_config(model_path="m", tp=1, seed=0, score_scale=2.5).structured == "free"


def test_sections_validate_when_built_directly() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        EngineSection(max_tokens=0)
    with pytest.raises(ValueError, match="prompts_per_step"):
        DataConfig(num_arithmetic_prompts=2, prompts_per_step=3)


def _int_keys() -> list[str]:
    keys = []
    hints = typing.get_type_hints(PipelineConfig)
    for section in dataclasses.fields(PipelineConfig):
        for name, tp in typing.get_type_hints(hints[section.name]).items():
            if tp is int or (typing.get_origin(tp) in (typing.Union, __import__("types").UnionType)
                             and int in typing.get_args(tp)):
                keys.append(f"{section.name}.{name}")
    return keys


INT_KEYS = _int_keys()
VALUES = st.one_of(st.integers(-(2**40), 2**40).map(str), st.sampled_from(["null", "1.5", "[1]", "{a: 1}", "x", ""]),
                   st.text(max_size=8))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(INT_KEYS), VALUES), min_size=1, max_size=3))
def test_random_integer_overrides_load_or_raise_config_error(pairs: list[tuple[str, str]]) -> None:
    overrides = [f"{key}={value}" for key, value in pairs]
    try:
        cfg = load_config(DEFAULT, overrides)
    except ConfigError as err:
        assert str(err)
        return
    for key, value in dict(pairs).items():  # the last override of a key wins
        section, name = key.split(".")
        if re.fullmatch(r"-?(0|[1-9][0-9]*)", value):
            assert getattr(getattr(cfg, section), name) == int(value)


ALL_KEYS = [f"{s.name}.{f.name}" for s in dataclasses.fields(PipelineConfig)
            for f in dataclasses.fields(typing.get_type_hints(PipelineConfig)[s.name])]
ANY_VALUES = st.one_of(VALUES, st.floats().map(str),
                       st.sampled_from(["[0.9, 0.95]", "true", "nan", "-inf", "1e400", "${run.seed}", "{x: 1}"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*ALL_KEYS, "deployment.strategy_cfg.horizon_s", "trainer.betas.0", "run"]),
                          ANY_VALUES), min_size=1, max_size=4))
def test_random_overrides_of_any_key_load_or_raise_config_error(pairs: list[tuple[str, str]]) -> None:
    try:
        load_config(DEFAULT, [f"{key}={value}" for key, value in pairs])
    except ConfigError as err:
        assert str(err)


def test_process_groups_live_where_their_tensors_do() -> None:
    """CPU runs keep gloo everywhere; a CUDA trainer's group is NCCL (FSDP2 collectives of CUDA tensors), the
    default group carries both, and GPS (host memory) stays on gloo."""
    from pivotrl.runtime.pipeline import process_group_backends

    assert process_group_backends(load_config(DEFAULT, [])) == {"default": "gloo", "training": "gloo", "gps": "gloo"}
    for device in ("cuda", "cuda:0"):
        cfg = load_config(DEFAULT, [f"trainer.device={device}"], for_cluster_only=True)
        assert process_group_backends(cfg) == {"default": "cpu:gloo,cuda:nccl", "training": "nccl", "gps": "gloo"}
