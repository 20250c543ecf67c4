"""Fault mechanics: how a fault is done to a run's processes (procs) and links (links, linkcap as
data). The supervisor undoes faults with them, chaos injects them, `down` lifts link caps."""
