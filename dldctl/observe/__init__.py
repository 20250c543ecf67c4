"""Looking at a run (the read side): the `status --json` snapshot, the live view, the report, the
list of runs and the merged logs."""
