"""The old import path of the workload seam, kept so that model factories written against it
(`from learner.workload import Workload, WorkloadContext`) keep working. The seam now lives in
the shared `workload` package, which the learner, the syncer's evaluator and the benchmarks use."""

from workload import Workload, WorkloadContext, batch_seed, build_workload

__all__ = ["Workload", "WorkloadContext", "batch_seed", "build_workload"]
