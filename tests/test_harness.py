"""The multi-process harness itself: a crashed rank fails the test at once instead of hanging."""
import os
import signal
import time

import pytest

import distributed


def _rank_one_crashes(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # rank 0 would wait for its peer; the harness must not
    return rank


def test_a_crashed_rank_fails_fast():
    # The message names the crash, not the 120 s timeout: the harness saw the dead rank.
    with pytest.raises(AssertionError, match="rank 1 died with exit code -11"):
        distributed.run(_rank_one_crashes, 2, timeout_s=120)
