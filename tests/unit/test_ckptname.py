"""The one reader of a checkpoint's file name (syncer/common/ckptname.py): the syncer's own
listing and the operator's status, `down` and shard rows all read names through it."""

from __future__ import annotations

import sys

from syncer.common import ckptname


def test_a_name_reads_as_its_epoch_step_and_time() -> None:
    name = ckptname.parse("ckpt-0002-000000780-1795961565494.pt")
    assert name is not None and (name.epoch, name.outer_step, name.wall_ms) == (2, 780, 1795961565494)
    assert name.wall_s == 1795961565.494
    assert ckptname.parse("ckpt-0002-x.pt") is None and ckptname.parse("history.json") is None


def test_the_newest_is_ordered_as_the_syncer_orders_its_checkpoints() -> None:
    names = ["ckpt-0001-000000060-1000.pt", "ckpt-0002-000000012-5000.pt", "history.json", "ckpt-0001-x.pt"]
    newest = ckptname.newest(names)
    assert newest is not None and (newest.epoch, newest.outer_step) == (2, 12)  # a newer epoch wins
    assert ckptname.newest(["history.json"]) is None


def test_the_syncer_reads_names_with_the_same_pattern() -> None:
    from syncer import checkpoint

    assert checkpoint.NAME is ckptname.NAME


def test_reading_a_name_does_not_import_torch() -> None:
    """`dldctl status` reads checkpoint names; it must not pay for torch to do so."""
    import subprocess

    code = "import sys, syncer.common.ckptname; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
