"""``python -m pivotrl.report RUN_DIR [--out DIR]``: timeline.png, trace.json and report.txt of a run."""
from __future__ import annotations

import argparse
import sys

from pivotrl.report import format_summary, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pivotrl.report", description=__doc__)
    parser.add_argument("run_dir", help="a run folder (holds events.jsonl)")
    parser.add_argument("--out", default=None, help="where the files go (default: the run folder)")
    args = parser.parse_args(argv)
    try:
        summary = report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"pivotrl.report: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    for name, path in summary["files"].items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
