"""The syncer process's own CPU time and resident memory, for its status answer (a shard on
another host reports them itself: the operator cannot read that host's /proc)."""

from __future__ import annotations

import os
import resource


def own_usage() -> dict[str, float | int | None]:
    """{"cpu_s": user + system CPU seconds of every thread, "rss_bytes": resident bytes now (None
    where /proc/self/statm cannot be read)}."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            rss: int | None = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = None
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "rss_bytes": rss}
