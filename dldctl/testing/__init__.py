"""The harness that drives the real `dldctl` CLI in a throw-away home, for tests and benchmarks.

Like `torch.testing`, this is library code for the project's own checks (tests/ and bench/ build
on it), not a part of the operator's commands. It never imports `learner` or torch: driving
dldctl needs neither, and a harness that starts in a fraction of a second keeps tests cheap.

    with DldctlHome(name="smoke") as home:              # DLDCTL_HOME = a new temp dir
        home.up({"model": "gpt-tiny", "H": 8}, [local_host("here", 2)])   # `dldctl up INV -d`
        snap = home.wait(lambda s: s["syncer"]["outer_steps"] >= 3, 120, "three merges")
        home.dl("chaos", "pause", "learner-0", "--duration", "5", "--force")
        home.events("death"), home.metrics("round"), home.config(), home.state()
        summary = home.down()                          # `dldctl down --json`
    # here nothing the home started is running, whatever happened in the block

Its parts, one concern each (import them from here):

- `home`: `DldctlHome`, `dldctl ARGS` run in its `DLDCTL_HOME` (`dl`, `popen`, `up`, `down`), what
  the run wrote (`config`, `state`, `events`, `metrics`, `log`), polls (`wait_for`, `wait` on
  `dldctl status --json`), and a teardown that always runs (`close()`, the context's exit).
- `procs`: processes by pid and start time only (`alive`, `signal_pid`), and `Processes`, named
  processes a harness started itself, always stopped at the end (tests/localrun.py runs a syncer
  and learners on it without dldctl).
- `waiting`: `wait_until` polls a check until it returns something true, or raises `WaitTimeout`
  naming what it waited for and what `describe()` says about the last try.
- `runfiles`: what goes into a run and what comes out (`inventory_text`, `local_host`,
  `local_config`, `read_jsonl`).

The errors are AssertionErrors, so pytest reports a failure, and the builtin a script catches:

    HarnessError(AssertionError)
     +-- CommandFailed(RuntimeError)    dldctl exited non-zero (`.proc` holds its output)
     +-- WaitTimeout(TimeoutError)      a condition did not hold in time
"""

from dldctl.testing.home import DLDCTL, DldctlHome
from dldctl.testing.procs import Processes, alive, signal_pid
from dldctl.testing.runfiles import inventory_text, local_config, local_host, read_jsonl, toml_value
from dldctl.testing.waiting import CommandFailed, HarnessError, WaitTimeout, wait_until

__all__ = [  # the harness's API: tests and bench import these from `dldctl.testing`
    "DLDCTL",
    "CommandFailed",
    "DldctlHome",
    "HarnessError",
    "Processes",
    "WaitTimeout",
    "alive",
    "inventory_text",
    "local_config",
    "local_host",
    "read_jsonl",
    "signal_pid",
    "toml_value",
    "wait_until",
]
