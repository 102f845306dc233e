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

    def logs(self, tail_chars: int = 3000) -> str:
        """The end of each rank's library log (``<run folder>/logs/rank-<r>.log``; ``run.log_level=quiet``)."""
        if self.folder is None:
            return ""
        parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-tail_chars:]}"
                 for p in sorted((self.folder / "logs").glob("rank-*.log"))]
        return "\n".join(parts)

    def explain(self) -> str:
        """The console's end and the ranks' logs: what a failed job left to read."""
        return f"{self.output[-4000:]}\n{self.logs()}"

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


def _proc_address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian 32-bit words) in the usual notation."""
    import ipaddress

    words = [bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    address = ipaddress.ip_address(b"".join(words))
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


class RunningJob:
    """A job started by ``start_job``: ``wait`` for it, or kill one rank (``kill_rank``) or all of it."""

    def __init__(self, proc: subprocess.Popen, out_dir: Path, timeout_s: float, master_port: int) -> None:
        import threading

        self.proc, self.out_dir, self.timeout_s = proc, out_dir, timeout_s
        self.master_port = master_port  # torchrun's store (its rendezvous), on MASTER_ADDR = 127.0.0.1
        self._chunks: list[str] = []  # the job's output so far (read all along: a full pipe would block the job)
        self._reader = threading.Thread(target=self._read, name="job-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._chunks.append(line)

    def output(self) -> str:
        """Everything the job printed so far (all of it once it has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._chunks)

    def folder(self) -> Path | None:
        """The newest run folder under ``out_dir`` (None before one exists)."""
        folders = sorted(p for p in self.out_dir.iterdir() if p.is_dir()) if self.out_dir.exists() else []
        return folders[-1] if folders else None

    def rank_pids(self) -> dict[int, int]:
        """Global rank -> pid of the job's worker processes now alive."""
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        ranked: dict[int, tuple[int, int]] = {}  # pid -> (rank, parent pid)
        for p in procs:
            try:
                env, parent = p.environ(), p.ppid()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "RANK" in env and "TORCHELASTIC_RUN_ID" in env and "LOCAL_RANK" in env:
                ranked[p.pid] = (int(env["RANK"]), parent)
        # a worker's own children (compile or helper processes) inherit its environment: the worker is the
        # one whose parent is not a worker (torchrun's agent started it)
        return {rank: pid for pid, (rank, parent) in ranked.items() if parent not in ranked}

    def listening_sockets(self) -> list[tuple[str, str, int]]:
        """(process, address, port) of every listening TCP socket of the job's processes, read from each
        process's own ``/proc/<pid>/net/tcp*`` (the job may run in a network namespace of its own).
        ``process`` is ``rank N`` for a worker, else the command's first words."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            try:
                env, cmd = p.environ(), p.cmdline()
                inodes = {os.readlink(f"/proc/{p.pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{p.pid}/fd")
                          if os.readlink(f"/proc/{p.pid}/fd/{fd}").startswith("socket:[")}
                table = [line.split() for name in ("tcp", "tcp6")
                         for line in Path(f"/proc/{p.pid}/net/{name}").read_text().splitlines()[1:]]
            except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
                continue
            who = f"rank {env['RANK']}" if "RANK" in env and "LOCAL_RANK" in env else " ".join(cmd[:4])
            for fields in table:
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, a socket this process holds
                    address, port = fields[1].split(":")
                    out.append((who, _proc_address(address), int(port, 16)))
        return sorted(set(out))

    def kill_rank(self, rank: int) -> int:
        """SIGKILL the worker process of global ``rank``; returns its pid."""
        pid = self.rank_pids().get(rank)
        if pid is None:
            raise LookupError(f"rank {rank} has no live process in this job")
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill(self) -> None:
        """SIGKILL every process of the job (torchrun's agents and every rank), as a crashed machine would."""
        kill_tree(self.proc.pid)
        self.proc.wait()

    def wait(self) -> Job:
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise AssertionError(f"the job did not finish within {self.timeout_s:.0f} s; last output:\n"
                                 f"{self.output()[-6000:]}") from None
        finally:
            kill_tree(self.proc.pid)
        return Job(self.proc.returncode, self.output(), self.folder())


def start_job(out_dir: Path, overrides: list[str], *, nnodes: int = 1, nproc: int = 4, timeout_s: float = 900,
              max_restarts: int = 0) -> RunningJob:
    """Start the pipeline in the background (see ``run_job``); ``max_restarts``: torchrun restarts the
    job this many times after a rank fails (the restarted job resumes its run folder)."""
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={port}", f"--rdzv_id=job-{port}",
                f"--max_restarts={max_restarts}", "--monitor_interval=0.5"]
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
    return RunningJob(proc, out_dir, timeout_s, port)


def run_job(out_dir: Path, overrides: list[str], *, nnodes: int = 1, nproc: int = 4, timeout_s: float = 900,
            max_restarts: int = 0) -> Job:
    """Run the pipeline; returns its exit code, output and run folder (None if none was made)."""
    return start_job(out_dir, overrides, nnodes=nnodes, nproc=nproc, timeout_s=timeout_s,
                     max_restarts=max_restarts).wait()
