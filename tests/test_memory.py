"""Fresh shard memory (runtime/memory.py): exact size, writable, and where it is mapped for
huge pages, huge pages only inside the tensor and every byte returned when it is freed."""

from __future__ import annotations

import pytest
import torch

from tpviz.runtime import memory
from tpviz.runtime.memory import fresh_tensor

KIB, MIB = 1 << 10, 1 << 20
SLACK = 512 * KIB  # the interpreter's own allocations between two readings


def _anon() -> dict[str, int]:
    """Anonymous and AnonHugePages bytes of this process, and the kernel's count of huge page
    faults that fell back to small pages (fragmented memory)."""
    fields = {}
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Anonymous", "AnonHugePages"):
                fields[key] = int(line.split()[1]) * KIB
    with open("/proc/vmstat", encoding="ascii") as f:
        for line in f:
            if line.startswith("thp_fault_fallback "):
                fields["fallback"] = int(line.split()[1])
    return fields


@pytest.mark.parametrize(
    "shape",
    [
        (1283, 1031),  # 5 MiB and 300 KiB: two whole huge pages and a tail of 4 KiB pages
        (300, 1031),  # 1.2 MiB: below one huge page
        (7,),
    ],
)
def test_fresh_tensor_is_exact_writable_and_returned_when_freed(shape):
    nbytes = torch.Size(shape).numel() * 4
    before = _anon()
    t = fresh_tensor(list(shape), torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == nbytes  # the storage holds exactly the tensor
    torch.arange(t.numel(), dtype=torch.float32, out=t.view(-1))  # written in place
    written = _anon()
    assert torch.equal(t.view(-1), torch.arange(t.numel(), dtype=torch.float32))
    # resident: the tensor's bytes in 4 KiB pages, not rounded up to a huge page
    assert -SLACK <= written["Anonymous"] - before["Anonymous"] - nbytes <= SLACK
    huge = memory._huge_page_size()
    if not huge or nbytes < huge:
        return  # from torch's allocator: malloc may keep freed memory for reuse
    assert t.data_ptr() % huge == 0
    if written.get("fallback") == before.get("fallback"):  # else memory was too fragmented
        assert written["AnonHugePages"] - before["AnonHugePages"] >= nbytes // huge * huge
    del t
    assert abs(_anon()["Anonymous"] - before["Anonymous"]) <= SLACK
