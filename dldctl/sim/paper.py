"""The Decoupled DiLoCo paper's goodput table, the simulator's reference (data only, no I/O).

Table 1 of "Decoupled DiLoCo for Resilient Distributed Pre-training" (arXiv 2604.21428), goodput
in percent by number of chips, chip MTBI about 1 year, as reported in secondary write-ups of the
paper. `dldctl simulate calibrate` fits its three time constants on the 150k column and predicts
the rest; `bench/sim_vs_paper.py` scores that prediction.
"""

from __future__ import annotations

PAPER_TABLE1_CSV = """\
strategy,learners,150000,300000,600000,1200000
data_parallel,,72,57,38,27
elastic_data_parallel,,88,80,69,58
decoupled_diloco,2,94,88,80,70
decoupled_diloco,4,96,93,89,82
decoupled_diloco,8,98,96,94,88
"""
PAPER_COLUMN = 150_000
PAPER_SOURCE = "Decoupled DiLoCo (arXiv 2604.21428), Table 1, as reported in secondary write-ups"
