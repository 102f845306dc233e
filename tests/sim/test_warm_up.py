"""``slots.warm_up`` compiles every signature a run calls, so nothing compiles once a real-time clock runs.

Checked in a fresh interpreter: in this one, earlier tests have compiled signatures of their own."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from pivotrl.scheduler import slots
from pivotrl.sim import SimConfig
from pivotrl.sim.runner import simulate
from simcases import DEPLOYMENTS, tiny_scenario
names = ("set_slot", "change_slot", "remove_slot", "dispatch", "migrate", "total_throughput")
seen = lambda: {{f: [str(s) for s in getattr(slots, f).signatures] for f in names}}
slots.warm_up()
before = seen()
shifts = {{k: simulate(SimConfig(scenario=tiny_scenario(), deployment=DEPLOYMENTS[k])).num_shifts
          for k in ("pivotrl", "disaggregated", "rr_colocated", "static")}}
print(json.dumps({{"before": before, "after": seen(), "shifts": shifts}}))
"""


def test_a_run_after_the_warm_up_compiles_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent))], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["shifts"]["pivotrl"] > 0  # the planner replayed shifts (Alg. 3 and 4)
    assert all(got["before"].values())
    assert got["after"] == got["before"]
