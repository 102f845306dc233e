"""``python -m pivotrl.runtime.check``: the paper configs validate and every figure is the runtime's own.

Also the model catalog (``pivotrl.gps.synthetic``): published parameter counts, the tensor names of
transformers' own modules, local checkpoint folders read from their safetensors headers.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.gps.layout import Parallelism, device_layout, specs_from_shapes
from pivotrl.gps.placement import place
from pivotrl.gps.synthetic import CATALOG, ArchFacts, Family, catalog_facts, dense_shapes, model_spec_for, moe_shapes
from pivotrl.runtime.check import SLOTS, check, device_numel, main, model_specs, role_memory
from pivotrl.runtime.config import ConfigError, load_config
from pivotrl.sim.catalog import DEVICES, MODELS

ROOT = Path(__file__).resolve().parents[2]
PAPER = sorted((ROOT / "launch" / "configs" / "paper").glob("*.yaml"))
SMALL = PAPER[0]  # qwen2.5-1.5b_glm-z1-9b: tp = 1 for both models
MODELS_JSON = Path("/work/shared/data/models.json")  # the facts' source, where this machine has it
SIM_NAME = {"GLM-Z1-9B-0414": "GLM-Z1-9B"}  # catalog key -> pivotrl.sim.catalog key where they differ


@pytest.fixture(scope="module")
def reports() -> dict[str, object]:
    return {p.stem: check(load_config(p, for_cluster_only=True)) for p in PAPER}


# ---------------------------------------------------------------- the catalog
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_models_have_the_published_parameter_counts(name: str) -> None:
    spec = CATALOG[name].spec()
    total = sum(p.numel for p in spec)
    assert total == MODELS[SIM_NAME.get(name, name)].total_params
    if MODELS_JSON.is_file():
        assert total == json.loads(MODELS_JSON.read_text())["models"][name]["total_params"]
    assert spec.nbytes == 2 * total and spec.num_experts == CATALOG[name].num_experts


def test_catalog_lookup_by_hub_id_or_last_component() -> None:
    assert catalog_facts("Qwen/Qwen2.5-7B") is CATALOG["Qwen2.5-7B"]
    assert catalog_facts("qwen3-30b-a3b") is CATALOG["Qwen3-30B-A3B"]
    assert catalog_facts("THUDM/GLM-Z1-9B-0414") is catalog_facts("zai-org/GLM-Z1-9B-0414")
    with pytest.raises(ValueError, match=r"Qwen2\.5-72B"):
        model_spec_for("Qwen/Qwen2.5-8B")


def _fused(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-expert checkpoint names as transformers' modules hold them: 3-D ``experts.gate_up_proj`` / ``down_proj``."""
    out: dict[str, tuple[int, ...]] = {}
    groups: dict[str, dict[str, object]] = {}  # "<layer>.mlp" -> number of experts and one expert's shapes
    for name, shape in shapes.items():
        if ".experts." not in name:
            out[name] = shape
            continue
        prefix, rest = name.split(".experts.")
        expert, proj = rest.split(".")[:2]
        group = groups.setdefault(prefix, {"n": 0})
        group["n"] = max(group["n"], int(expert) + 1)  # type: ignore[call-overload]
        group[proj] = shape
    for prefix, g in groups.items():
        gate, down = g["gate_proj"], g["down_proj"]
        out[f"{prefix}.experts.gate_up_proj"] = (g["n"], 2 * gate[0], gate[1])  # type: ignore[index]
        out[f"{prefix}.experts.down_proj"] = (g["n"], *down)  # type: ignore[misc]
    return out


def _small_arch(family: Family) -> ArchFacts:
    return ArchFacts(family=family, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=64, attention_bias=family in ("qwen2", "glm4"), intermediate_size=48,
                     num_experts=4 if "moe" in family else 0, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16 if family == "qwen3_5_moe" else 0,
                     full_attention_interval=4 if family == "qwen3_5_moe" else 0, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


def _hf_model(f: ArchFacts):  # noqa: ANN202 (a transformers module)
    import torch
    import transformers as tf

    common = dict(hidden_size=f.hidden_size, num_hidden_layers=f.num_layers, num_attention_heads=f.num_heads,
                  num_key_value_heads=f.num_kv_heads, head_dim=f.head_dim, vocab_size=f.vocab_size,
                  tie_word_embeddings=False, pad_token_id=0)
    moe = dict(num_experts=f.num_experts, num_experts_per_tok=2, moe_intermediate_size=f.moe_intermediate_size)
    config, cls = {
        "qwen2": lambda: (tf.Qwen2Config(**common, intermediate_size=f.intermediate_size), tf.Qwen2ForCausalLM),
        "glm4": lambda: (tf.Glm4Config(**common, intermediate_size=f.intermediate_size, attention_bias=True),
                         tf.Glm4ForCausalLM),
        "qwen3_moe": lambda: (tf.Qwen3MoeConfig(**common, **moe), tf.Qwen3MoeForCausalLM),
        "qwen3_5_moe": lambda: (tf.Qwen3_5MoeTextConfig(
            **common, **moe, shared_expert_intermediate_size=f.shared_expert_intermediate_size,
            linear_num_key_heads=f.linear_num_key_heads, linear_num_value_heads=f.linear_num_value_heads,
            linear_key_head_dim=f.linear_key_head_dim, linear_value_head_dim=f.linear_value_head_dim,
            linear_conv_kernel_dim=f.linear_conv_kernel_dim), tf.Qwen3_5MoeForCausalLM),
    }[f.family]()
    with torch.device("meta"):
        return cls(config)


@pytest.mark.parametrize("family", ["qwen2", "glm4", "qwen3_moe", "qwen3_5_moe"])
def test_builders_name_and_shape_what_transformers_holds(family: str) -> None:
    facts = _small_arch(family)
    theirs = {n: tuple(t.shape) for n, t in _hf_model(facts).state_dict().items()}
    assert _fused(facts.shapes()) == theirs


def test_the_catalog_matches_its_facts_on_the_hybrid_layer_pattern() -> None:
    spec = CATALOG["Qwen3.5-122B-A10B"].spec()
    full = {p.layer for p in spec if ".self_attn." in p.name}
    linear = {p.layer for p in spec if ".linear_attn." in p.name}
    assert full == set(range(3, 48, 4)) and len(linear) == 36 and not full & linear
    assert sum(1 for p in spec if p.name.endswith("experts.0.up_proj.weight")) == 48 and spec.num_experts == 256


# ---------------------------------------------------------------- local checkpoint folders
def test_a_local_checkpoint_folder_is_read_from_its_headers(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shapes = dense_shapes(hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                          vocab_size=40, tie_word_embeddings=True)
    names = sorted(shapes)
    half = len(names) // 2
    save_file({n: torch.zeros(shapes[n], dtype=torch.bfloat16) for n in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({n: torch.zeros(shapes[n], dtype=torch.float32) for n in names[half:]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    spec = model_spec_for(str(tmp_path))
    assert {p.name: p.shape for p in spec} == shapes and spec.num_layers == 2
    for file in ("a", "b"):
        with safe_open(str(tmp_path / f"{file}.safetensors"), "pt") as f:
            for name in f.keys():
                assert spec[name].shape == tuple(f.get_slice(name).get_shape())
                assert spec[name].itemsize == {"BF16": 2, "F32": 4}[f.get_slice(name).get_dtype()]
    cfg = load_config(SMALL, [f"models.policy={tmp_path}"], for_cluster_only=True)
    report = check(cfg)
    assert report.model_bytes["policy"] == spec.nbytes
    assert report.roles[0].weight_bytes == 2 * sum(p.numel for p in spec)  # rollout.dtype bfloat16, tp = 1


def test_a_tp_the_model_cannot_split_names_the_tp_key(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    shapes = dense_shapes(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8,
                          vocab_size=16)  # k_proj: 4 rows, fewer than tp = 8
    save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, str(tmp_path / "m.safetensors"))
    cfg = load_config(SMALL, [f"models.policy={tmp_path}", "models.policy_tp=8"], for_cluster_only=True)
    with pytest.raises(ConfigError, match=r"^models\.policy_tp: the rollout layout of models\.policy is impossible"):
        check(cfg)


def test_a_folder_without_weights_is_an_error_naming_the_key(tmp_path: Path) -> None:
    cfg = load_config(SMALL, [f"models.genrm={tmp_path}"], for_cluster_only=True)
    with pytest.raises(ConfigError, match=r"^models\.genrm: .*no \*\.safetensors"):
        check(cfg)


# ---------------------------------------------------------------- the paper configs
@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_every_paper_config_validates_with_figures(path: Path, reports: dict) -> None:
    r = reports[path.stem]
    cfg = load_config(path, for_cluster_only=True)
    assert r.placement.node_bytes > 0 and r.placement.is_replicated  # no budget: unlimited
    assert [m.role for m in r.roles] == ["rollout", "reward", "training"] and all(m.fits for m in r.roles)
    assert [m.num_devices for m in r.roles] == [cfg.models.policy_tp, cfg.models.genrm_tp, cfg.num_training_devices]
    assert all(m.hbm_bytes == DEVICES["H20"].hbm_bytes for m in r.roles)
    for t in r.transfers:
        assert t.nbytes > 0 and t.num_transfers > 0 and t.planned_s > 0 and t.planning_s > 0
    read_policy, read_genrm, write = r.transfers
    assert read_policy.devices == tuple(range(cfg.models.policy_tp))  # one replica on node 0
    assert write.nbytes == cfg.cluster.num_nodes * r.model_bytes["policy"]  # every node's copy, replicated
    assert json.loads(json.dumps(r.to_dict()))["placement"]["host_bytes_per_node"] == r.placement.node_bytes


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_placement_agrees_with_place(path: Path, reports: dict) -> None:
    cfg = load_config(path, for_cluster_only=True)
    specs = model_specs(cfg)
    assert reports[path.stem].placement == place(specs, num_nodes=cfg.cluster.num_nodes, node_budget_bytes=None,
                                                 slots={"policy": 2, "genrm": 1})
    full = reports[path.stem].placement.node_bytes
    budget = full // 2 + 1  # does not fit replicated: hybrid
    hybrid = check(cfg, node_budget_bytes=budget).placement
    assert hybrid == place(specs, num_nodes=cfg.cluster.num_nodes, node_budget_bytes=budget, slots=SLOTS)
    assert hybrid.group_size >= 2 and hybrid.node_bytes <= budget


def test_a_budget_no_sharding_meets_names_the_cluster() -> None:
    with pytest.raises(ConfigError, match=r"^cluster\.num_nodes: GPS placement impossible"):
        check(load_config(SMALL, for_cluster_only=True), node_budget_bytes=1 << 30)


def test_the_paper_groups_reward_replica_holds_its_experts_and_dense_share(reports: dict) -> None:
    """Qwen3-30B-A3B at tp = ep = 4: each device holds 32 experts per layer whole plus a quarter of the dense part."""
    spec = CATALOG["Qwen3-30B-A3B"].spec()
    layout = device_layout(spec, range(4), Parallelism(tp=4, ep=4))
    expert = sum(p.numel for p in spec if p.expert is not None)
    split = sum(p.numel for p in spec if p.expert is None and p.kind != "replicated")
    replicated = sum(p.numel for p in spec if p.expert is None and p.kind == "replicated")
    assert sum(device_numel(layout).values()) == expert + split + 4 * replicated
    assert reports["qwen2.5-7b_qwen3-30b-a3b"].roles[1].weight_bytes == 2 * max(device_numel(layout).values())


# ---------------------------------------------------------------- per-device memory is exact
def _split_and_replicated(spec) -> tuple[int, int]:  # noqa: ANN001
    split = sum(p.numel for p in spec if p.kind != "replicated" and p.expert is None)
    return split, sum(p.numel for p in spec if p.kind == "replicated" and p.expert is None)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.sampled_from([8, 16]), kv=st.sampled_from([8, 4]), head_dim=st.sampled_from([2, 4]),
       layers=st.integers(1, 3), inter=st.integers(8, 40), vocab=st.integers(8, 50), tied=st.booleans(),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_dense_replica_devices_hold_the_model_exactly_once(heads: int, kv: int, head_dim: int, layers: int, inter: int,
                                                           vocab: int, tied: bool, tp: int) -> None:
    """Sum over a tp replica's devices: every split parameter once, every replicated one on each device."""
    spec = specs_from_shapes(dense_shapes(hidden_size=heads * head_dim, num_layers=layers, num_heads=heads,
                                          num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
                                          vocab_size=vocab, tie_word_embeddings=tied), layers)
    numel = device_numel(device_layout(spec, range(tp), Parallelism(tp=tp)))
    split, replicated = _split_and_replicated(spec)
    assert sum(numel.values()) == split + tp * replicated
    memory = role_memory("rollout", "policy", device_layout(spec, range(tp), Parallelism(tp=tp)), Parallelism(tp=tp),
                         "bfloat16", DEVICES["H20"])
    assert memory.weight_bytes == memory.state_bytes == 2 * max(numel.values())


@settings(max_examples=25, deadline=None)
@given(experts=st.integers(4, 12), layers=st.integers(1, 3), ep=st.sampled_from([1, 2, 4]))
def test_moe_replica_counts_each_routed_expert_once(experts: int, layers: int, ep: int) -> None:
    spec = specs_from_shapes(moe_shapes(hidden_size=16, num_layers=layers, num_heads=4, num_kv_heads=4, head_dim=4,
                                        moe_intermediate_size=8, num_experts=experts, vocab_size=20), layers)
    layout = device_layout(spec, range(ep), Parallelism(tp=ep, ep=ep))
    held = dict.fromkeys(range(ep), 0)
    for name, pieces in layout.pieces.items():
        if spec[name].expert is not None:
            for pc in pieces:
                assert len(pc.holders) == 1  # a routed expert lives whole on one ep rank
                held[pc.holders[0]] += pc.box.numel
    per_expert = 3 * 8 * 16 * layers
    assert sum(held.values()) == experts * per_expert
    assert {held[d] // per_expert for d in held} <= {experts // ep, -(-experts // ep)}
    split, replicated = _split_and_replicated(spec)
    assert sum(device_numel(layout).values()) == experts * per_expert + split + ep * replicated


def test_training_state_is_fsdp_shards_of_params_grads_and_adam() -> None:
    spec = CATALOG["Qwen2.5-1.5B"].spec()
    layout = device_layout(spec, range(16), Parallelism(dp=16, dp_shard=True))
    numel = device_numel(layout)
    assert sum(numel.values()) == sum(p.numel for p in spec)  # FSDP: every element on exactly one device
    bf16 = role_memory("training", "policy", layout, Parallelism(dp=16, dp_shard=True), "bfloat16", DEVICES["H20"])
    fp32 = role_memory("training", "policy", layout, Parallelism(dp=16, dp_shard=True), "float32", DEVICES["H20"])
    assert bf16.state_bytes == 8 * max(numel.values()) and fp32.state_bytes == 16 * max(numel.values())


# ---------------------------------------------------------------- errors and the command line
def test_a_bad_config_key_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SMALL), "models.polcy=x"]) == 2
    err = capsys.readouterr().err
    assert "models.polcy: unknown key" in err and "policy_tp" in err


@pytest.mark.parametrize("key", ["policy", "genrm"])
def test_an_unknown_model_names_the_field_and_the_known_models(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(SMALL, [f"models.{key}=Acme/Acme-13B"], for_cluster_only=True)
    with pytest.raises(ConfigError, match=rf"^models\.{key}: unknown model 'Acme/Acme-13B'") as err:
        check(cfg)
    assert all(name in str(err.value) for name in CATALOG)
    assert main([str(SMALL), f"models.{key}=Acme/Acme-13B"]) == 2
    assert f"models.{key}" in capsys.readouterr().err


def test_the_command_line_prints_a_table_and_json() -> None:
    cfg = ROOT / "launch" / "configs" / "paper" / "qwen2.5-7b_qwen3-30b-a3b.yaml"
    proc = subprocess.run([sys.executable, "-m", "pivotrl.runtime.check", str(cfg), "--json", "--node-memory-gib", "50",
                           "deployment.training_devices=16", "data.prompts_per_step=128"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["placement"]["kind"] == "hybrid" and out["placement"]["group_size"] == 2
    assert out["placement"]["node_budget_bytes"] == 50 << 30
    assert out["roles"][2]["num_devices"] == 16 and out["transfers"][2]["devices"] == list(range(16, 32))
    assert any(line.startswith("GPS placement: hybrid, k = 2") for line in lines)


def test_the_embedded_default_is_checked_from_its_built_checkpoints() -> None:
    """``tiny`` / ``tiny-moe`` resolve to the embedded folders (as the pipeline resolves them), whose
    safetensors headers give the shapes: an MoE GenRM's per-expert tensors split whole across ep ranks."""
    from pivotrl.roles.tiny_moe import ensure_tiny_moe_genrm

    cfg = load_config(ROOT / "launch" / "configs" / "default.yaml", ["models.genrm=tiny-moe"], for_cluster_only=True)
    report = check(cfg)
    moe = model_spec_for(str(ensure_tiny_moe_genrm()))
    assert report.model_bytes["genrm"] == moe.nbytes and moe.num_experts > 1
    assert report.placement.is_replicated and all(t.nbytes > 0 for t in report.transfers)
    training = next(r for r in report.roles if r.role == "training")
    assert training.num_devices == cfg.deployment.training_devices == 2 and training.parallelism == "dp=2, FSDP"
