"""Opening the inventory's hosts: the transport each `[[hosts]]` entry or site names.

A host at address "local" is this machine (LocalHost), any other an SSHHost with the inventory's
[ssh] settings (paramiko is imported only then); a scheduler site is a SlurmHost around the host
that reaches its login node. The run model's bridge from the inventory to dldctl/hosts/.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dldctl.hosts import Host, LocalHost
from dldctl.hosts.slurm import SlurmHost
from dldctl.hosts.slurmjobs import SiteJob
from dldctl.inventory import HostSpec, Inventory


def open_host(spec: HostSpec, inv_ssh: Any, known_hosts: str | None = None) -> Host:
    """A LocalHost for address "local", else an SSHHost with the inventory's SSH settings; a
    scheduler site is a SlurmHost around the one that reaches its login node."""
    if spec.site:
        machine = replace(spec, scheduler="")
        return SlurmHost(spec.name, open_host(machine, inv_ssh, known_hosts), site_job(spec), spec.env)
    if spec.local:
        return LocalHost(spec.name)
    from dldctl.hosts.ssh import SSHHost  # paramiko only where a host needs it

    return SSHHost(
        spec.name,
        spec.address,
        user=spec.user or inv_ssh.user or None,
        port=spec.port or inv_ssh.port or None,
        identity_file=inv_ssh.identity_file or None,
        known_hosts=known_hosts or inv_ssh.known_hosts,
        host_key_policy=inv_ssh.host_key_policy,
        proxy_jump=inv_ssh.proxy_jump or None,
        connect_timeout=inv_ssh.connect_timeout,
        use_ssh_config=inv_ssh.use_ssh_config,
    )


def host_for(inv: Inventory, name: str) -> Host:
    """The host named `name` in the inventory (a name it does not know: this machine)."""
    spec = next((h for h in inv.hosts if h.name == name), None)
    return LocalHost(name) if spec is None else open_host(spec, inv.ssh)


def site_job(spec: HostSpec) -> SiteJob:
    """What each learner job of a site asks its scheduler for."""
    return SiteJob(
        partition=spec.partition,
        account=spec.account,
        nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node,
        cpus_per_task=spec.threads * spec.nproc,
        time=spec.time,
        extra=tuple(spec.sbatch_args),
    )
