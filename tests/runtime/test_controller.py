"""The runtime controller over fake workers: the control plane's accounting holds for every deployment.

The workers are ``fakes.FakeBus`` (deterministic engines behind real JSON messages), so these tests
run in milliseconds and cover what real engines make slow to reach: migrations over messages,
sequences that finish before their abort arrives, every shift direction under the chaos strategy.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control import DeploymentConfig, make_deployment
from pivotrl.roles.data import PromptDataset
from pivotrl.roles.reward import RewardConfig
from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer
from pivotrl.runtime.book import RolloutBook
from pivotrl.runtime.clock import WallClock
from pivotrl.runtime.controller import ControllerSpec, RuntimeCluster, Sampling
from pivotrl.runtime.config import RunConfig, WaitsConfig
from pivotrl.scheduler import ThroughputModel

from fakes import FakeBus

NUM_DEVICES = 4
DEPLOYMENTS = {
    "colocated": DeploymentConfig(kind="colocated", staleness=0),
    "disaggregated": DeploymentConfig(kind="disaggregated", rollout_devices=2, reward_devices=1, training_devices=1),
    "rr_colocated": DeploymentConfig(kind="rr_colocated", rollout_devices=2, training_devices=2, staleness=1),
    "pivotrl": DeploymentConfig(kind="shiftable", strategy="pivotrl", training_devices=2, staleness=1, tick_s=0.01,
                                max_tick_s=0.05),
    "chaos": DeploymentConfig(kind="shiftable", strategy="chaos", training_devices=2, staleness=1, tick_s=0.001,
                              max_tick_s=0.002),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_tiny_checkpoints().policy_path)


def _run(dep: DeploymentConfig, tokenizer, *, num_steps: int = 3, prompts: int = 4, group: int = 2,
         kv_tokens: int = 100_000, rollout_kv_tokens: int | None = None,
         up_delay_seed: int | None = None, tape=None, bus_kwargs: dict | None = None,
         spec_kwargs: dict | None = None, rollout_max_tokens: int = 6,
         lengths=None) -> tuple[RuntimeCluster, FakeBus]:
    bus = FakeBus(NUM_DEVICES, answer_ids=tokenizer.encode("Answer: 1"), up_delay_seed=up_delay_seed,
                  **(bus_kwargs or {}))
    book = RolloutBook(PromptDataset.arithmetic(16, seed=0), tokenizer, prompts_per_step=prompts, group_size=group,
                       seed=0, reward=RewardConfig(on_unparsed="verifiable_only"), genrm_prompt_tokens=400,
                       lengths=lengths)
    model = ThroughputModel(A=1e-7, B=1e-3, C=1e-4, D=1e-3)
    kwargs = dict(spec_kwargs or {})
    run = RunConfig(timeout_s=20, fit_engines=kwargs.pop("fit_engines", False), prepare_engines=False,
                    prepare_training=kwargs.pop("prepare_training", False))
    waits = WaitsConfig(shutdown_s=kwargs.pop("shutdown_s", WaitsConfig().shutdown_s))
    spec = ControllerSpec(num_nodes=1, devices_per_node=NUM_DEVICES, run=run, waits=waits,
                          sampling={"rollout": Sampling(max_tokens=rollout_max_tokens, temperature=1.0),
                                    "reward": Sampling(max_tokens=4, temperature=0.0)},
                          belief={"rollout": model, "reward": model},
                          kv_capacity_tokens={"rollout": rollout_kv_tokens or kv_tokens, "reward": kv_tokens},
                          **kwargs)
    rows: list[dict] = []
    dep.check(NUM_DEVICES, 1, 1)
    cluster = RuntimeCluster(spec, bus, book, make_deployment(dep, NUM_DEVICES), num_steps=num_steps,
                             on_step=rows.append,
                             clock=WallClock(source=bus.time))  # the fakes' time: the same decisions on any machine
    bus.kv_capacity_tokens = {"rollout": rollout_kv_tokens or kv_tokens, "reward": kv_tokens}  # what engines report
    if tape is not None:  # record what the plane is told and does (tests/control/tape.py)
        tape.record(cluster.plane)
    cluster.run()
    cluster.save_policy("/nowhere")
    cluster.shutdown()
    cluster.rows = rows  # type: ignore[attr-defined]
    return cluster, bus


def run_recorded(dep: DeploymentConfig, tape, **kwargs) -> tuple[RuntimeCluster, FakeBus]:
    return _run(dep, load_tokenizer(ensure_tiny_checkpoints().policy_path), tape=tape, **kwargs)


def _check_accounting(cluster: RuntimeCluster, bus: FakeBus, num_steps: int) -> None:
    ledger, book = cluster.plane.ledger, cluster.book
    B = book.seqs_per_step
    assert ledger.rollouts_done == [B] * num_steps and ledger.judged == [B] * num_steps  # each once
    assert sorted(set(bus.trained_steps)) == list(range(num_steps))
    assert bus.trained_sequences == B * num_steps  # every sequence trained exactly once
    assert all(r.response_ids is not None and r.reward is not None for r in book.records.values())
    assert len(book.records) == B * num_steps
    rows = cluster.rows  # type: ignore[attr-defined]
    assert [r["step"] for r in rows] == list(range(num_steps))
    assert all(r["version_lag_max"] <= ledger.staleness for r in rows)
    assert cluster.published_version == num_steps == bus.gps_version  # GPS holds the last trained version
    engine_tokens = sum(cluster.tokens_by_role.values())
    final = sum(len(r.response_ids or ()) + len(r.judgement_ids or ()) for r in book.records.values())
    assert engine_tokens == bus.generated_tokens == final  # no token lost or generated twice
    assert not cluster.occupancy_violations and bus.max_roles_held <= 1
    for driver in cluster.plane.drivers.values():
        assert driver.num_live == 0
        driver.scheduler.check_invariants()
    if ledger.first_step == 0:  # the event record replays into the same books (a resumed run's covers its part)
        from pivotrl.control.events import read_events
        from pivotrl.report import held_seconds, replay, slices

        events = read_events(cluster.plane.events.events)
        books = replay(events)
        assert books.rollouts_done == ledger.rollouts_done and books.judged == ledger.judged
        assert books.trained_steps == list(range(num_steps)) and books.num_shifts == len(cluster.plane.shifts)
        assert books.tokens_by_role == dict(cluster.tokens_by_role)
        assert sum(p["count"] for p in books.shift_phases.values()) == len(cluster.shift_reports)
        held = held_seconds(slices(events))
        for role in ("rollout", "reward", "training"):
            assert held[role] == pytest.approx(cluster.plane.held_device_seconds(until=cluster.plane.finished_s)[role],
                                               rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_every_deployment_keeps_the_books(name: str, tokenizer) -> None:
    cluster, bus = _run(DEPLOYMENTS[name], tokenizer)
    _check_accounting(cluster, bus, 3)


@pytest.mark.parametrize("name", ["disaggregated", "colocated", "rr_colocated"])
def test_a_static_deployment_whose_kv_holds_a_few_sequences_finishes(name: str, tokenizer) -> None:
    """Nothing but finishes free room on a static deployment: the driver must dispatch the queue into
    it (the runtime used to wait for the next submit or shift, forever)."""
    book = RolloutBook(PromptDataset.arithmetic(16, seed=0), tokenizer, prompts_per_step=4, group_size=2, seed=0,
                       reward=RewardConfig(on_unparsed="verifiable_only"), genrm_prompt_tokens=400)
    longest = max(n for step in range(3) for _, n in book.rollouts(step))
    kv = 2 * (longest + 6)  # two rollouts at a time per replica; a step has 8
    cluster, bus = _run(DEPLOYMENTS[name], tokenizer, num_steps=3, rollout_kv_tokens=kv, kv_tokens=420)
    _check_accounting(cluster, bus, 3)
    rollout_adds = [msg for _, msg in bus.sent if msg.kind == "AddSequences"
                    and cluster._role_by_replica[msg.replica_id] == "rollout"]
    assert max(len(msg.seqs) for msg in rollout_adds) <= 2  # it really held no more than two at once


LAW = ThroughputModel(A=4e-6, B=2e-2, C=1.5e-3, D=6e-3)  # nothing like the prior (A=1e-7, B=1e-3, ...)


def _belief_checks(cluster: RuntimeCluster, role: str, law: ThroughputModel) -> dict:
    belief, driver = cluster.beliefs[role], cluster.plane.drivers[role]
    assert driver.spec.model == belief.model  # what the planner's snapshot reads
    for rid in driver.replicas:  # and what the scheduler dispatches by
        assert driver.scheduler.replica(rid).model == belief.model
    report = belief.report()
    assert report["samples"] >= 24
    return report


def test_the_belief_converges_to_the_engines_law(tokenizer) -> None:
    """Fake engines whose latency follows a law unlike the prior (and whose profile reports the prior's
    constants, a stale cache): the reports refit the belief until it predicts the engines."""
    prior = ThroughputModel(A=1e-7, B=1e-3, C=1e-4, D=1e-3)
    cluster, bus = _run(DEPLOYMENTS["disaggregated"], tokenizer, num_steps=3,
                        kv_tokens=50_000, bus_kwargs={"latency_law": LAW, "profile_law": prior,
                                    "rollout_length": lambda seq_id: 30 + seq_id % 11},
                        spec_kwargs={"fit_engines": True}, rollout_max_tokens=48)
    _check_accounting(cluster, bus, 3)
    assert bus.fits_reported == 2  # one profile per role: its first replica
    report = _belief_checks(cluster, "rollout", LAW)
    assert [h["source"] for h in report["history"]][:2] == ["prior", "profile"]
    assert "refit" in [h["source"] for h in report["history"]]
    assert report["final"]["error"]["median"] <= 0.02  # the fake's latencies are exact: so is the fit
    stale = [h for h in report["history"] if h["source"] == "profile"][0]
    assert stale["while_held"]["n"] == 0 or stale["while_held"]["median"] > 0.5  # the stale fit was far off
    assert all(driver.spec.kv_capacity_tokens == 50_000 for driver in cluster.plane.drivers.values())  # ReplicaUp's


def test_a_profile_that_matches_needs_no_refit(tokenizer) -> None:
    cluster, bus = _run(DEPLOYMENTS["disaggregated"], tokenizer, num_steps=2,
                        bus_kwargs={"latency_law": LAW, "rollout_length": lambda seq_id: 30 + seq_id % 11},
                        spec_kwargs={"fit_engines": True}, rollout_max_tokens=48)
    report = _belief_checks(cluster, "rollout", LAW)
    assert [h["source"] for h in report["history"]] == ["prior", "profile"]
    assert report["final"]["error"]["median"] <= 1e-6


@pytest.mark.parametrize("name", ["disaggregated", "chaos"])
def test_synthetic_lengths_are_generated_exactly(name: str, tokenizer) -> None:
    """data.lengths = lognormal: each response is generated to the length drawn for it, through migrations."""
    from pivotrl.runtime.book import SyntheticLengths
    from pivotrl.sim.workload import LengthDist

    lengths = SyntheticLengths(response=LengthDist(median=10, sigma=0.8, max_tokens=24), judgement=None, seed=3,
                               prompts_per_step=4, group_size=2)
    cluster, bus = _run(DEPLOYMENTS[name], tokenizer, lengths=lengths, rollout_max_tokens=24)
    _check_accounting(cluster, bus, 3)
    drawn = {s: lengths.tokens("rollout", s) for s in cluster.book.records}
    assert {s: len(r.response_ids) for s, r in cluster.book.records.items()} == drawn
    assert len(set(drawn.values())) > 3  # a spread, not one length


def test_chaos_shifts_in_every_direction(tokenizer) -> None:
    cluster, bus = _run(DEPLOYMENTS["chaos"], tokenizer, num_steps=4, prompts=2, group=4)
    _check_accounting(cluster, bus, 4)
    ups = [(r["role"], r["device"]) for r in cluster.shift_reports if r.get("direction") == "up"]
    downs = [(r["role"], r["device"]) for r in cluster.shift_reports if r.get("direction") == "down"]
    history: dict[int, list[str]] = {}
    for r in sorted(cluster.shift_reports, key=lambda r: r["time_s"]):
        if r.get("direction") == "up":
            history.setdefault(r["device"], []).append(r["role"])
    moves = {(a, b) for roles in history.values() for a, b in zip(roles, roles[1:]) if a != b}
    assert ("rollout", "reward") in moves and ("reward", "rollout") in moves
    assert {("rollout", "training"), ("reward", "training")} & moves  # inference -> training
    assert {("training", "rollout"), ("training", "reward")} & moves  # training -> inference
    assert ups and downs


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), prompts=st.integers(1, 3), group=st.integers(1, 4),
       kv_tokens=st.integers(420, 1500))  # at least one longest GenRM prompt (400) + judgement fits
def test_chaos_random_sizes_never_lose_or_duplicate(seed: int, prompts: int, group: int, kv_tokens: int,
                                                     tokenizer) -> None:
    dep = DeploymentConfig(kind="shiftable", strategy="chaos", strategy_cfg={"seed": seed}, training_devices=2,
                           staleness=1, tick_s=0.001, max_tick_s=0.002)
    cluster, bus = _run(dep, tokenizer, num_steps=2, prompts=prompts * 4, group=group, kv_tokens=kv_tokens)
    _check_accounting(cluster, bus, 2)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(DEPLOYMENTS)), seed=st.integers(0, 10_000))
def test_replicas_coming_up_one_by_one_never_give_a_device_two_roles(name: str, seed: int, tokenizer) -> None:
    """Each ReplicaUp and each Written arrives 0-12 engine iterations late, in any order: stage switches
    wait for the starting replicas of the role they stop (the fake refuses a second role on a device),
    and a step is released whichever comes last, its replicas or its policy version."""
    cluster, bus = _run(DEPLOYMENTS[name], tokenizer, num_steps=2, up_delay_seed=seed)
    _check_accounting(cluster, bus, 2)


def test_a_worker_that_never_stops_fails_the_shutdown_naming_its_wait(tokenizer, monkeypatch) -> None:
    """The shutdown waits ``waits.shutdown_s``, then fails saying which wait."""
    from pivotrl.runtime.controller import RunFailed

    monkeypatch.setattr(FakeBus, "_Shutdown", lambda self, device, msg: None)  # no worker says Bye
    with pytest.raises(RunFailed, match=r"every worker to stop \(waits\.shutdown_s\)"):
        _run(DEPLOYMENTS["disaggregated"], tokenizer, num_steps=1, spec_kwargs={"shutdown_s": 0.2})


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("name", ["colocated", "disaggregated", "pivotrl"])
def test_validations_reach_their_steps_rows_in_order_whenever_they_arrive(name: str, prepared: bool,
                                                                        tokenizer) -> None:
    """The initial policy's validation (at start-up when the trainer is prepared, else inside step 0) and each later
    one (sent after the version's Write, possibly after the next step's publication) land on their own step's
    metrics row, every share counted once; rows go out in step order, and the run's time ends at the last
    publication, before the last validation is in."""
    num_steps = 4
    cluster, bus = _run(DEPLOYMENTS[name], tokenizer, num_steps=num_steps, up_delay_seed=5,
                        spec_kwargs={"eval_every": 2, "prepare_training": prepared,
                                     "training_device_ids": DEPLOYMENTS[name].training_set(NUM_DEVICES)})
    rows = cluster.rows  # type: ignore[attr-defined]
    _check_accounting(cluster, bus, num_steps)
    trainers = len(DEPLOYMENTS[name].training_set(NUM_DEVICES))
    assert bus.trainer_prepared == (set(DEPLOYMENTS[name].training_set(NUM_DEVICES)) if prepared else set())
    assert rows[0]["eval_before"] == {"version": 0, "num_prompts": trainers, "greedy_accuracy": 1.0, "k": 2,
                                      "avg_at_k": 0.5, "seconds": 0.01}
    assert all("eval_before" not in r for r in rows[1:])
    assert [r["step"] for r in rows if "eval_after" in r] == [1, 3]  # every 2nd step and the last
    for r in rows:
        if "eval_after" in r:
            assert r["eval_after"]["version"] == r["step"] + 1 and r["eval_after"]["num_prompts"] == trainers
            assert r["eval_after"]["greedy_accuracy"] == float((r["step"] + 1) % 2 == 0)
    assert cluster.rows_pending == 0 and cluster.finished_s is not None
    assert cluster.finished_s <= cluster.clock.now()

