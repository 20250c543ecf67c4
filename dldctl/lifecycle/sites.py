"""Scheduler sites before anything is submitted: whether each site's jobs could run at all.

`dldctl check` reports every problem of every site; `dldctl up` and `learner add --site` refuse
with the first one, naming the site and the key to change, before a run directory exists or a
job is queued (an unknown partition, an account that may not use it, a time limit over the
partition's maximum, missing Slurm commands). A login node that does not answer is not a
configuration error: `up` leaves that site out as it leaves out an unreachable host.
"""

from __future__ import annotations

from dldctl.errors import ConfigError, HostError
from dldctl.hostopen import open_host
from dldctl.hosts.slurm import SlurmHost
from dldctl.inventory import HostSpec, Inventory


def problems(inv: Inventory, spec: HostSpec) -> list[str]:
    """The site's problems (empty: its jobs can be submitted); HostError if its login does not answer."""
    host = open_host(spec, inv.ssh)
    try:
        host.home()
        return host.problems() if isinstance(host, SlurmHost) else []
    finally:
        host.close()


def preflight(inv: Inventory, names: list[str] | None = None) -> None:
    """Raise ConfigError for the first site (of `names`, default every site with learners) whose
    jobs its scheduler would refuse or never run."""
    for spec in inv.hosts:
        if not spec.site or (names is None and spec.learners == 0) or (names is not None and spec.name not in names):
            continue
        try:
            found = problems(inv, spec)
        except HostError:
            continue  # unreachable: up leaves it out (and says so); check reports it
        if found:
            more = f" (and {len(found) - 1} more: `dldctl check` lists them)" if len(found) > 1 else ""
            raise ConfigError(inv.path, f"sites.{spec.name}", found[0] + more)
