"""Looking at a run: the `status --json` snapshot, the live view, the report, and mirroring a remote
syncer's records home."""
