import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.page_advice import advise_small_pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_large_array_is_kept_off_huge_pages_and_stays_zero() -> None:
    array = np.zeros(64 << 20, dtype=np.uint8)
    assert advise_small_pages(array)
    start = array.ctypes.data
    smaps = Path("/proc/self/smaps").read_text()
    region = next(
        block
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps)
        if int(block.split("-")[0], 16)
        <= start + (4 << 20)
        < int(block.split()[0].split("-")[1], 16)
    )
    assert " nh" in region.split("VmFlags:")[1]  # the kernel's flag for MADV_NOHUGEPAGE
    array[::4096] = 1
    assert int(array.sum()) == len(range(0, array.size, 4096))


def test_a_small_array_is_left_alone() -> None:
    assert not advise_small_pages(np.zeros(16, dtype=np.uint8))
