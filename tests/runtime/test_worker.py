"""Workers on two torchrun ranks driven by a scripted controller (``worker_job.py``), on real parts:
vLLM engines, the GRPO trainer over gloo, GPS over NIXL. Checks migration-invariant abort/resume across
devices, reward and training shifts, the collective GPS write, a live reload and the saved policy."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pivotrl.runtime.jobs import kill_tree

pytestmark = [pytest.mark.dist, pytest.mark.engine]
JOB = Path(__file__).with_name("worker_job.py")
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated(cmd: list[str]) -> list[str]:
    """``cmd`` in a private network namespace with only loopback up, where the machine allows it."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return cmd
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True)
    if probe.returncode != 0:
        return cmd
    return ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("worker_job")
    env = {**os.environ, "UCX_TLS": "self,sm", "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo",
           "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = _isolated([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                     f"--master_port={_free_port()}", str(JOB), str(out)])
    log = out / "job.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # torchrun and both ranks (torchrun starts each rank in a session of its own)
            proc.wait()
    errors = "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(out.glob("*error*.txt")))
    tail = log.read_text(errors="replace")[-6000:]
    assert proc.returncode == 0 and not errors, f"rc={proc.returncode}\n{errors}\n--- job.log tail\n{tail}"
    assert all((out / f"rank{r}.json").exists() for r in (0, 1)), tail
    return json.loads((out / "result.json").read_text()), out


def test_every_reply_reports_at_most_one_role_and_the_right_one(job) -> None:
    result, _ = job
    expected = {"ReplicaDown": [], "TrainingDown": [], "Trained": ["training"]}
    for entry in result["log"]:
        held = entry["roles_held"]
        assert len(held) <= 1, entry
        if entry["kind"] in expected:
            assert held == expected[entry["kind"]], entry
    assert result["up1"]["roles_held"] == ["rollout"] and result["up3"]["roles_held"] == ["reward"]
    assert result["bye"] == [0, 1]


def test_ranks_without_work_sleep(job) -> None:
    """While device 1 holds no role and device 0 an idle replica (the controller waits ``IDLE_S``), each rank's
    process (engine, GPS, NIXL and bus threads together) uses well under half a core: nothing spins (a
    spinning thread alone uses a whole one)."""
    result, out = job
    start, end = result["idle_window"]
    for rank in (0, 1):
        samples = [(t, cpu) for t, cpu in json.loads((out / f"rank{rank}.json").read_text())["cpu_samples"]
                   if start <= t <= end]
        (t0, cpu0), (t1, cpu1) = samples[0], samples[-1]
        print(f"rank {rank}: {cpu1 - cpu0:.3f} CPU s in {t1 - t0:.2f} s idle")
        assert t1 - t0 > 1.0, samples
        assert (cpu1 - cpu0) / (t1 - t0) < 0.5, (rank, cpu1 - cpu0, t1 - t0)


def test_prepared_engines_start_at_start_up_and_serve_without_an_engine_start(job) -> None:
    """PrepareEngines starts each named engine once (a repeated role once) and releases it in place; the role's
    first shift up onto the device then pays no engine start, and the engine generates as a fresh one does (the
    abort/resume test compares device 0's prepared engine with device 1's fresh one token for token)."""
    result, _ = job
    prepared = result["prepared"]
    assert set(prepared["0"]) == {"rollout"} and set(prepared["1"]) == {"reward"}
    for report in (prepared["0"]["rollout"], prepared["1"]["reward"]):
        assert report["prepared"] and report["release_mode"] == "inplace" and report["start_s"] > 0
    assert result["up2"]["report"]["engine_start_s"] == 0.0  # rollout onto device 0: prepared
    assert result["up3"]["report"]["engine_start_s"] == 0.0  # reward onto device 1: prepared
    assert result["up3"]["report"]["parameters_bytes"] > 0 and result["judgement"]
    assert result["up1"]["report"]["engine_start_s"] > 0  # rollout onto device 1 was not prepared


def test_a_replica_reads_its_weights_from_gps_on_one_rank_alone(job) -> None:
    result, _ = job  # device 1 read from device 0's host copy (NIXL, one-sided) while rank 0 idled
    up = result["up1"]
    assert up["version"] == 0 and up["report"]["parameters_bytes"] > 0 and up["kv"] > 0


def test_abort_and_resume_on_another_device_matches_the_uninterrupted_run(job) -> None:
    result, _ = job
    partial, resumed, uninterrupted = result["partial"], result["resumed"], result["uninterrupted"]
    assert partial and set(partial) | set(result["finished_before_abort"]) == set(uninterrupted)
    assert result["streamed"] == partial  # the Progress stream carried exactly the tokens the worker held
    for seq_id, ids in partial.items():
        assert len(ids) >= 6 and resumed[seq_id][: len(ids)] == ids
    assert resumed == uninterrupted
    for seq_id, values in result["resumed_logprobs"].items():  # migrated over messages: the same log-probs
        assert values == pytest.approx(result["logprobs"][seq_id], abs=1e-5), seq_id
    assert len({tuple(ids) for ids in uninterrupted.values()}) == len(uninterrupted)


def test_reward_and_training_shifts(job) -> None:
    result, _ = job
    assert result["down1"]["direction"] == "down" and result["down1"]["temporary_bytes"] > 0
    assert result["up3"]["role"] == "reward" and result["up3"]["version"] == 0 and result["judgement"]
    first, second = result["trained"]
    for t in (first, second):
        assert t["report"]["direction"] == "up" and t["report"]["version"] == 0 and t["report"]["parameters_bytes"] > 0
        assert t["roles_held"] == ["training"] and t["stats"]["grad_norm"] > 0
    assert first["stats"]["num_tokens"] == second["stats"]["num_tokens"]  # global over the training group
    assert first["stats"]["loss"] == pytest.approx(second["stats"]["loss"])
    assert result["training_down"] == [[], []]


def test_a_write_is_reported_inside_the_training_step_after_it(job) -> None:
    """The next step's rollouts wait for the version a Write publishes; a device reports it as soon as it is done,
    not once the training step that followed it ends."""
    result, _ = job
    assert result["write_during_training"] == {"0": ["Written", "Trained"], "1": ["Written", "Trained"]}


def test_a_training_device_finishes_its_write_before_it_takes_an_inference_role(job) -> None:
    """The Write of the version a device just trained is published before the device's new role comes up (the
    next rollouts wait for that publication), and the new replica serves that version."""
    result, _ = job
    assert result["write_before_shift_up"] == {"0": [["Written", 3], ["ReplicaUp", 3]],
                                               "1": [["Written", 3], ["ReplicaUp", 3]]}


def test_the_trainer_is_built_at_start_up_and_validates_the_initial_policy(job) -> None:
    """PrepareTraining: each device's share of the initial policy's validation; its parameters are then freed,
    so the first step's shift up reads them from GPS."""
    result, _ = job
    for share in result["training_ready"]:
        assert share["version"] == 0 and share["num_prompts"] == 1 and share["num_samples"] == 1
        assert 0 <= share["greedy_correct"] <= 1 and 0 <= share["sampled_correct"] <= 1
    for t in result["trained"]:
        assert t["report"]["parameters_bytes"] > 0  # the first step loaded them (a shift up), not the build


def test_a_validation_runs_after_the_write_of_the_version_it_scores(job) -> None:
    """A step's validation does not hold up its publication: each device reports the Write, then the validation
    of that version."""
    result, _ = job
    for device in ("0", "1"):
        (written, v_written), (validated, v_validated, share) = result["validated_after_write"][device]
        assert (written, v_written, validated, v_validated) == ("Written", 4, "Validated", 4)
        assert share["version"] == 4 and share["num_prompts"] == 1


def test_write_reload_and_saved_policy_agree(job) -> None:
    from safetensors.torch import load_file

    from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
    from pivotrl.roles.tiny import ensure_tiny_checkpoints

    result, out = job
    assert result["up4"]["version"] == 0 and result["written"] == [1, 1] and result["reloaded"] == 1
    assert len(result["during_reload"]) == 4  # sequences in flight across the write and the reload all finish
    assert result["saved"] == {"path": str(out / "saved"), "version": 1}
    saved = Path(result["saved"]["path"])
    trained = load_file(str(saved / "model.safetensors"))
    original = load_file(str(ensure_tiny_checkpoints().policy_path / "model.safetensors"))
    assert trained.keys() == original.keys() and any(not torch.equal(trained[n], original[n]) for n in original)
    assert (saved / "tokenizer.json").exists() and (saved / "config.json").exists()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(saved))
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    prompts = {int(s): ids for s, ids in result["prompts"].items()}
    config = EngineConfig(model_path=str(saved), max_model_len=512, kv_cache_bytes=32 << 20, seed=7)
    with EngineReplica(config) as fresh:  # the saved v1, loaded by vLLM from disk
        for s, ids in prompts.items():
            fresh.add(300 + s, ids, sampling=SequenceSampling(max_tokens=24, temperature=1.0))
        done = {}
        while fresh.has_unfinished():
            done.update({str(f.seq_id): list(f.token_ids) for f in fresh.step().finished})
    assert done == result["after_reload"]  # the reloaded replica served exactly the written version
