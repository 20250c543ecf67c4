"""Keeping a run at its declared size with nobody watching: the supervisor, its pure decisions
(`reconcile`), the watchdog that restarts it, and the warm spares."""
