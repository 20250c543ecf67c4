"""Keeping a run at its declared size with nobody watching: the supervisor, its pure decisions
(`reconcile`), the watchdog that restarts it, the warm spares, and what only it runs: `launch`,
the metrics sinks, the mirror of a remote syncer's records, the alerts."""
