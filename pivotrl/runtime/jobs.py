"""Start ``launch/pivotrl.py`` under torchrun on this machine (tests, benchmarks, notebooks): one or
more "nodes" on 127.0.0.1, in a private network namespace where the machine allows it (only loopback
is up), with a hard timeout; every process of the job is killed when it ends or times out.

Invariant: ``run_job`` returns only after every process it started has exited.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository (launch/ lives beside pivotrl/)
LAUNCHER = ROOT / "launch" / "pivotrl.py"


@dataclass
class Job:
    returncode: int
    output: str
    folder: Path | None

    @property
    def summary(self) -> dict[str, Any]:
        assert self.folder is not None, self.output[-4000:]
        return json.loads((self.folder / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict[str, Any]]:
        assert self.folder is not None, self.output[-4000:]
        return [json.loads(line) for line in (self.folder / "metrics.jsonl").read_text().splitlines()]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun starts its workers in sessions of their own)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def run_job(out_dir: Path, overrides: list[str], *, nnodes: int = 1, nproc: int = 4, timeout_s: float = 900) -> Job:
    """Run the pipeline; returns its exit code, output and run folder (None if none was made)."""
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={port}"]
    args = [str(LAUNCHER), f"run.out_dir={out_dir}", "run.progress=false", f"cluster.num_nodes={nnodes}",
            f"cluster.devices_per_node={nproc}", *overrides]
    commands = [" ".join([*torchrun, f"--node_rank={i}", *args]) for i in range(nnodes)]
    script = commands[0]
    if nnodes > 1:  # every "node" in the background; the job fails if any node fails
        starts = "; ".join(f"{c} & p{i}=$!" for i, c in enumerate(commands))
        waits = "; ".join(f"wait $p{i} || rc=1" for i in range(nnodes))
        script = f"rc=0; {starts}; {waits}; exit $rc"
    if _can_unshare():
        script = f"ip link set lo up 2>/dev/null; {script}"
        argv = ["unshare", "-n", "sh", "-c", script]
    else:
        argv = ["sh", "-c", script]
    env = {**os.environ, "UCX_TLS": "self,sm", "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        raise AssertionError(f"the job did not finish within {timeout_s:.0f} s; last output:\n{output[-6000:]}")
    finally:
        kill_tree(proc.pid)
    folders = sorted(p for p in out_dir.iterdir() if p.is_dir()) if out_dir.exists() else []
    return Job(proc.returncode, output, folders[-1] if folders else None)
