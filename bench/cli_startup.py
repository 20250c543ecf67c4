"""Benchmark: how long an everyday `dldctl` command takes to start, against importing every command.

An operator runs `dldctl status` in loops and scripts, and the test suite drives hundreds of
commands on a busy machine; each used to import every command group's module (paramiko for SSH
hosts, numpy for the simulator) before it did anything. Now the root group imports a command's
module when it runs (dldctl/cli.py, `COMMANDS`). Per command, the best wall time of `--repeats`
runs of the real console script in a home with no run (the command's own "no run yet" is
expected), and the same run's baseline: a fresh interpreter that imports `dldctl.cli` and builds
every command with the libraries their modules imported at the top until 2026-12-05 (paramiko,
numpy, importlib.metadata: what each command paid before), and a bare interpreter.

    ratio = command / every command imported      (below 1: the command pays for less)

    .venv/bin/python bench/cli_startup.py             # 7 repeats
    .venv/bin/python bench/cli_startup.py --quick     # 3 repeats
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

DLDCTL = str(Path(sys.executable).parent / "dldctl")
COMMANDS = (["status", "--json"], ["events"], ["runs", "--json"], ["logs", "syncer"], ["chaos", "kill", "learner-0"])
# what every command imported before it ran, until 2026-12-05: every command's module, with
# paramiko (SSH hosts), numpy (wire protocol, workload) and importlib.metadata at their tops
EVERYTHING = (
    "from dldctl.cli import COMMANDS, load_command\nfor name in COMMANDS: load_command(name)\n"
    "import dldctl.hosts.ssh, numpy, importlib.metadata"
)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=None, help="runs per command (default 7, quick 3)")


def best(argv: list[str], env: dict[str, str], repeats: int) -> float:
    """The fastest of `repeats` runs of `argv`, in seconds."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, timeout=120)
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("cli_startup", __doc__, _extra, argv)
    repeats = args.repeats or (3 if args.quick else 7)
    with tempfile.TemporaryDirectory(prefix="dld-cli-") as home:
        env = dict(os.environ, DLDCTL_HOME=home)
        bare = best([sys.executable, "-c", "pass"], env, repeats)
        everything = best([sys.executable, "-c", EVERYTHING], env, repeats)
        rows = []
        for c in COMMANDS:
            took = best([DLDCTL, *c], env, repeats)
            rows.append(
                {
                    "command": "dldctl " + " ".join(c),
                    "s": round(took, 3),
                    "every command imported s": round(everything, 3),
                    "python alone s": round(bare, 3),
                    "ratio": round(took / everything, 2),
                }
            )
    common.print_table(f"dldctl start-up, best of {repeats} (a home with no run)", rows)
    common.write_json(args.out, {"benchmark": "cli_startup", "repeats": repeats, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
