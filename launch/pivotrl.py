"""PivotRL: RL post-training with a GenRM where devices shift between rollout, reward and training.

    torchrun --standalone --nproc_per_node=4 launch/pivotrl.py [--config FILE] [key=value ...]

Every torchrun rank stands for one device; rank 0 also runs the controller. The default config is
the embedded tiny policy + tiny GenRM on CPU (``launch/configs/default.yaml``); ``key=value``
overrides any field (``deployment.kind=disaggregated``, ``data.path=dapo-math-17k.parquet``, ...).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "default.yaml"
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path.pop(0)  # this script's folder would shadow the ``pivotrl`` package with this very file


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launch/pivotrl.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: the embedded one)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def init_distributed(timeout: datetime.timedelta, backend: str = "gloo") -> None:
    """The default process group (``backend``: ``pipeline.process_group_backends``). A job torchrun restarted (``--max-restarts``) rendezvouses under a key
    prefix of its own: the store still holds the keys, and so the addresses, of the ranks that died."""
    import torch.distributed as dist

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=hosts_store,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"pivotrl-restart-{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from pivotrl.runtime.config import ConfigError, load_config

    rank = int(os.environ.get("RANK", "0"))
    try:  # every rank validates the config; rank 0 also reads the files (data, checkpoints), and its
        # exit makes torchrun stop the others before any worker starts
        cfg = load_config(args.config, args.overrides, for_cluster_only=rank != 0)
    except ConfigError as err:
        if rank == 0:
            print(f"pivotrl: bad config: {err}", file=sys.stderr)
        return 2
    from pivotrl.runtime.checkpoint import ResumeError, check_resumable, latest
    from pivotrl.runtime.pipeline import (
        process_group_backends,
        resume_folder,
        run,
        setup_process_env,
        training_device_ids,
    )

    if rank == 0:  # a resume that cannot work stops the job here, like a bad config
        try:
            folder = resume_folder(cfg)
            if folder is not None and (cfg.run.resume is not False or latest(folder) is not None):
                check_resumable(folder, cfg.to_yaml(), cfg.run.num_steps, len(training_device_ids(cfg)))
        except ResumeError as err:
            print(f"pivotrl: cannot resume: {err}", file=sys.stderr)
            return 2

    setup_process_env(int(os.environ.get("LOCAL_RANK", "0")), cfg.gps.transport)
    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("pivotrl: start me with torchrun, e.g. torchrun --standalone --nproc_per_node="
              f"{cfg.cluster.devices_per_node} launch/pivotrl.py", file=sys.stderr)
        return 2
    init_distributed(datetime.timedelta(seconds=cfg.waits.collective_s), process_group_backends(cfg)["default"])
    try:
        result = run(cfg)
    finally:
        dist.destroy_process_group()
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
