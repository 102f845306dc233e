"""``Deployment.engine_roles``: the inference roles a device may ever serve, whose engines a run starts there at
start-up (``PrepareEngines``). Checked against what each deployment really does: every replica a simulated run
starts, in every deployment, is of a role its devices' ``engine_roles`` name; and no pool device of a static
deployment prepares an engine it never uses."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pivotrl.control import DeploymentConfig, make_deployment
from pivotrl.sim import SimConfig, Simulator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from simcases import DEPLOYMENTS, tiny_scenario  # noqa: E402


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_every_replica_a_run_starts_is_of_a_role_its_devices_prepared(name: str) -> None:
    from pivotrl.sim.runner import make_deployment as sim_deployment

    cfg = SimConfig(scenario=tiny_scenario(), deployment=DEPLOYMENTS[name])
    sim = Simulator(cfg, sim_deployment(cfg))
    backend, started = sim.plane.backend, []
    start = backend.start_replicas

    def recording(role, replicas, *args):
        started.extend((role, device) for _, group in replicas for device in group)
        return start(role, replicas, *args)

    backend.start_replicas = recording
    sim.run()
    deployment = sim.plane.deployment
    assert started
    for role, device in started:
        assert role in deployment.engine_roles(device), (role, device, deployment.engine_roles(device))
    if name in ("disaggregated", "rr_colocated"):  # a static pool prepares exactly the roles it serves
        used = {d: {r for r, dev in started if dev == d} for d in range(cfg.scenario.num_devices)}
        for device, roles in used.items():
            assert set(deployment.engine_roles(device)) == roles, device


def test_the_static_pools() -> None:
    dis = make_deployment(DeploymentConfig(kind="disaggregated", rollout_devices=2, reward_devices=1,
                                           training_devices=1), 4)
    assert [dis.engine_roles(d) for d in range(4)] == [("rollout",), ("rollout",), ("reward",), ()]
    rr = make_deployment(DeploymentConfig(kind="rr_colocated", rollout_devices=3, training_devices=1), 4)
    assert [rr.engine_roles(d) for d in range(4)] == [("rollout", "reward")] * 3 + [()]
    for kind in ("colocated", "shiftable"):
        dep = make_deployment(DeploymentConfig(kind=kind, training_devices=2), 4)
        assert all(dep.engine_roles(d) == ("rollout", "reward") for d in range(4))
