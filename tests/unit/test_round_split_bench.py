"""bench/round_split.py: a round's stages are timed where the core calls them, and nothing of
the timing is left behind in the process."""

from __future__ import annotations

import pytest

from bench import round_split as rs
from bench import syncer_throughput as st
from syncer.native import Kernel
from syncer.wire import codec


@pytest.mark.skipif(st.KERNEL is None, reason="no native kernel here")
def test_the_stages_add_up_to_less_than_the_round_and_the_wrappers_are_gone() -> None:
    before = (codec._payload, codec._blob, Kernel.check, Kernel.gram, Kernel.publish)
    row = rs.split("gpt-tiny", repeat=3)
    assert (codec._payload, codec._blob, Kernel.check, Kernel.gram, Kernel.publish) == before
    stages = [row[f"{s}_ms"] for s in ("decompress", "encode", "check", "gram", "publish")]
    assert all(v > 0 for v in stages), row  # every stage ran (a renamed call would time nothing)
    assert row["native_ms"] == pytest.approx(sum(stages))
    assert 0 < row["native_ms"] < row["round_ms"] and row["rest_ms"] > 0
    assert row["native_share"] > row["bound_share"] > 0
