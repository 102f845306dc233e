"""What a real run reports (§8.1 metrics): one row per RL step for ``metrics.jsonl``, the accounting the
summary and the tests check, and where device time went.

Plain functions over a ``RuntimeCluster``'s counters (the controller only counts); every figure is
derived from the workers' own reports (engine tokens and latencies, shift reports, trainer stats) and
the rollout book.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pivotrl.planner.state import INFERENCE_ROLES

if TYPE_CHECKING:
    from pivotrl.runtime.controller import RuntimeCluster

__all__ = ["step_row", "accounting", "step_books", "time_breakdown", "engine_rates", "shifts_by_role"]


def step_row(cluster: RuntimeCluster, step: int, prev: dict[str, Any]) -> dict[str, Any]:
    """One metrics row per published version: this step's rewards and staleness, the tokens and
    shifts since the previous row, and the run's totals so far (the controller adds the step's validations,
    ``eval_before`` / ``eval_after``, when they are in)."""
    now = cluster.clock.now()
    since = now - prev.get("time_s", 0.0)
    stats = cluster.train_stats.get(step, [])
    row: dict[str, Any] = {"step": step, "version": step + 1, "time_s": now, **cluster.book.step_metrics(step)}
    if stats:
        row["loss"] = stats[0].get("loss")
        row["train_seconds"] = max(s.get("seconds", 0.0) for s in stats)
        for key in _GLOBAL_TRAIN_STATS:  # the trainer reduces these over its ranks
            if key in stats[0]:
                row[key] = stats[0][key]
    totals = {r: cluster.tokens_by_role[r] for r in INFERENCE_ROLES}
    before = prev.get("tokens_total_by_role", {r: 0 for r in INFERENCE_ROLES})
    row["tokens_by_role"] = {r: totals[r] - before[r] for r in INFERENCE_ROLES}
    row["tps_by_role"] = {r: row["tokens_by_role"][r] / since if since > 0 else 0.0 for r in INFERENCE_ROLES}
    row["tps_overall"] = sum(row["tokens_by_role"].values()) / since if since > 0 else 0.0
    row["engine_tps_by_role"] = {r: totals[r] / cluster.engine_seconds[r] if cluster.engine_seconds[r] else 0.0
                                 for r in INFERENCE_ROLES}  # tokens per second of engine-step time
    row["tokens_total_by_role"] = totals
    row["tps_run"] = sum(totals.values()) / now if now > 0 else 0.0  # end-to-end so far (§8.1)
    first = prev.get("num_shift_reports", 0)
    row["shifts"] = cluster.shift_reports[first:]
    row["num_shift_reports"] = len(cluster.shift_reports)
    row["num_plans"] = len(cluster.plane.shifts)
    row["devices_by_role"] = cluster.plane.devices_by_role()
    return row


_GLOBAL_TRAIN_STATS = ("num_tokens", "clip_fraction", "grad_norm", "ratio_max_abs_dev", "behaviour_weight_mean",
                       "behaviour_weight_max", "num_capped", "is_skipped")


def validation(shares: list[dict[str, Any]]) -> dict[str, Any]:
    """One validation from the training ranks' shares: greedy accuracy and avg@k over the whole set."""
    prompts, samples = sum(s["num_prompts"] for s in shares), sum(s["num_samples"] for s in shares)
    greedy, sampled = sum(s["greedy_correct"] for s in shares), sum(s["sampled_correct"] for s in shares)
    return {"version": shares[0]["version"], "num_prompts": prompts, "greedy_accuracy": greedy / prompts,
            "k": samples // prompts, "avg_at_k": sampled / samples if samples else None,
            "seconds": max(s["seconds"] for s in shares)}


def step_books(cluster: RuntimeCluster, *, upto: int | None = None) -> dict[str, list[int]]:
    """Per-step counts of steps ``[0, upto)`` (default: every step): rollouts, judgements, sequences sent to
    the trainer, the trainer's token count and the response tokens it should have counted. Steps before a
    resumed run's first step come from its checkpoint (``cluster.prior_books``)."""
    ledger, book = cluster.plane.ledger, cluster.book
    steps = range(ledger.num_steps if upto is None else upto)
    kept: dict[int, int] = {}
    for r in book.records.values():
        if r.reward is not None and r.reward.total is not None:
            kept[r.step] = kept.get(r.step, 0) + len(r.response_ids or ())
    here = {"rollouts_done": lambda k: ledger.rollouts_done[k], "judged": lambda k: ledger.judged[k],
            "trainer_tokens_by_step": lambda k: sum(s.get("num_tokens", 0) for s in cluster.train_stats[k][:1]),
            "kept_response_tokens_by_step": lambda k: kept.get(k, 0),
            "trained_sequences_by_step": lambda k: cluster.trained_sequences.get(k, 0)}
    prior, first = cluster.prior_books, ledger.first_step
    return {key: [prior[key][k] if k < first else count(k) for k in steps] for key, count in here.items()}


def accounting(cluster: RuntimeCluster) -> dict[str, Any]:
    """What the tests and the summary check: counts per step from the ledger, the book and the
    workers' own reports (engine tokens, trainer tokens, roles held). A resumed run's engine and
    sequence tokens are those of this process (``resumed_from_step`` says where it began)."""
    ledger, book = cluster.plane.ledger, cluster.book
    return {
        **step_books(cluster), "trained_steps": ledger.trained,
        "resumed_from_step": ledger.first_step if cluster.resumed is not None else None,
        "engine_tokens": sum(cluster.tokens_by_role.values()),
        "sequence_tokens": sum(len(r.response_ids or ()) + len(r.judgement_ids or ())
                               for r in book.records.values()),
        "max_roles_held": cluster.max_roles_held,  # over every report of every worker
        "time_breakdown": time_breakdown(cluster),
        # device-seconds each role held until the run's end (the event record's end too): the plane's own account
        "held_device_s": cluster.plane.held_device_seconds(until=cluster.plane.finished_s),
        "engine_rates": engine_rates(cluster),
        "shifts_by_role": shifts_by_role(cluster),
        "staleness_waits": {"count": len(cluster.plane.staleness_waits), "seconds": cluster.plane.staleness_wait_s},
        "beliefs": {role: belief.report() for role, belief in cluster.beliefs.items()},
        "kv_capacity_tokens": {role: d.spec.kv_capacity_tokens for role, d in cluster.plane.drivers.items()},
        "planner_decisions": len(cluster.plane.planner_calls),
        "planner_s": sum(sum(call) for call in cluster.plane.planner_calls),  # controller time inside plan()
    }


def time_breakdown(cluster: RuntimeCluster) -> dict[str, float]:
    """Where device time went, from the first placement to the last publication: engine iterations per role,
    shifts (all context kinds), training steps, validations inside that time (every one but the last step's,
    which runs after the last publication; the initial policy's when it runs inside step 0, not at start-up),
    and the rest (idle: waiting for work, for messages, or for another role's shift)."""
    end = cluster.finished_s if cluster.finished_s is not None else cluster.clock.now()
    device_s = end * cluster.spec.num_devices
    engine = {f"engine_{r}_s": cluster.engine_seconds[r] for r in INFERENCE_ROLES}
    shift_s = sum(r.get("seconds", 0.0) for r in cluster.shift_reports)
    train_s = sum(s.get("seconds", 0.0) for stats in cluster.train_stats.values() for s in stats)
    last = cluster.plane.ledger.num_steps - 1
    inside = {"after": lambda step: step != last, "before": lambda step: not cluster.spec.run.prepare_training}
    validation_s = sum(share.get("seconds", 0.0) for (when, step), shares in cluster.validations.items()
                       if inside[when](step) for share in shares)
    busy = sum(engine.values()) + shift_s + train_s + validation_s
    return {"device_s": device_s, **engine, "shift_s": shift_s, "train_s": train_s, "validation_s": validation_s,
            "idle_s": max(device_s - busy, 0.0)}


def engine_rates(cluster: RuntimeCluster) -> dict[str, dict[str, float]]:
    """Per inference role: tokens its engines generated, the seconds of their iterations, and tokens per
    engine-second (what one engine delivers while it runs; the run's tok/s also counts its waits)."""
    out = {}
    for role in INFERENCE_ROLES:
        tokens, seconds = cluster.tokens_by_role[role], cluster.engine_seconds[role]
        out[role] = {"tokens": tokens, "engine_s": seconds, "tokens_per_engine_s": tokens / seconds if seconds else 0.0}
    return out


def shifts_by_role(cluster: RuntimeCluster) -> dict[str, dict[str, float]]:
    """Per ``<role> <direction>`` (``rollout up``, ``training down``, ``rollout reload``: new weights into a live
    replica, ...): how many the workers reported, their seconds, and, for shifts, their seconds per context
    kind (``temporary_s``, ``parameters_s``, ...)."""
    out: dict[str, dict[str, float]] = {}
    for report in cluster.shift_reports:
        entry = out.setdefault(f"{report['role']} {report['direction']}", {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        for key, value in report.items():
            if key == "seconds" or (key.endswith("_s") and key != "time_s"):
                entry[key] = entry.get(key, 0.0) + value
    return dict(sorted(out.items()))
