"""/sys/block/NAME/stat as the kernel writes it."""

from __future__ import annotations

import pytest

from reconciler.facts.iostat import IoCounters, parse_busy, parse_stat

# Recorded in the kernel tests' VM (6.1) from a krbd device during a partition:
# 147 reads and 76 writes completed, 2 in flight, no discards or flushes.
KRBD_STALLED = ("     147        1     2834      151       76       91    70484     8752"
                "        2    27708     8903        0        0        0        0        0"
                "        0\n")


def test_a_6_1_line_counts_every_completion_and_what_is_in_flight() -> None:
    assert parse_stat(KRBD_STALLED) == IoCounters(completed=223, in_flight=2)


def test_discards_and_flushes_count_as_completions() -> None:
    line = "1 0 0 0 2 0 0 0 0 0 0 3 0 0 0 4 0"
    assert parse_stat(line) == IoCounters(completed=10, in_flight=0)


def test_an_old_kernel_line_of_eleven_fields() -> None:
    assert parse_stat("5 0 40 1 7 0 56 2 1 3 3") == IoCounters(12, 1)


@pytest.mark.parametrize("text", ["", "1 2 3", "a b c d e f g h i j k", "1 2 3 4 5 6 7 8 9 10 x"])
def test_anything_else_is_no_counters(text: str) -> None:
    assert parse_stat(text) is None


def test_a_flush_the_driver_holds_is_counted_from_debugfs() -> None:
    # blk_mq_debugfs_rq_show's line for each request the driver holds.
    busy = ("00000000b5a1e2c4 {.op=FLUSH, .cmd_flags=, .rq_flags=FLUSH_SEQ|STARTED|ELVPRIV, "
            ".state=in_flight, .tag=5, .internal_tag=-1}\n"
            "000000007f00aa01 {.op=WRITE, .cmd_flags=SYNC|FUA, .rq_flags=STARTED|IO_STAT, "
            ".state=in_flight, .tag=6, .internal_tag=-1}\n"
            "0000000011112222 {.op=READ, .cmd_flags=, .rq_flags=, .state=idle, .tag=7, "
            ".internal_tag=-1}\n")
    assert parse_busy(busy) == 2
    assert parse_busy("") == 0
