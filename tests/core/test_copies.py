"""`wtransfer.copies`: every byte lands, whatever the group a copy went out in, and
a fenced queue's side stream never overtakes work queued on the current stream between its
copies."""

from __future__ import annotations

import os

import pytest
import torch

from wtransfer.copies import (
    GROUP_MAX,
    MEMCPY_BYTES,
    STREAMS,
    WHOLE_UPDATE_STREAMS,
    CopyQueue,
    _side_streams,
    copy_bytes,
)


def _pairs(sizes: list[int], device: str, seed: int = 0) -> tuple[list[torch.Tensor],
                                                                  list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device)
            for n in sizes]
    return [torch.zeros_like(s) for s in srcs], srcs


def test_a_queue_lands_every_host_copy():
    sizes = [7, 1 << 20, 3, 65536] * (GROUP_MAX // 2) + [0, 1]
    dsts, srcs = _pairs(sizes, "cpu")
    queue = CopyQueue()
    for d, s in zip(dsts, srcs, strict=True):
        queue.add(d, s)
    queue.close()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_copy_bytes_refuses_a_length_mismatch_and_an_unpaired_list():
    with pytest.raises(ValueError, match="3 bytes into 4"):
        copy_bytes([torch.zeros(4, dtype=torch.uint8)], [torch.ones(3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        copy_bytes([torch.zeros(4, dtype=torch.uint8)], [torch.ones(4, dtype=torch.uint8)] * 2)
    with pytest.raises(ValueError, match="3 bytes into 4"):
        CopyQueue().add(torch.zeros(4, dtype=torch.uint8), torch.ones(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="streams must be at least 1, got 0"):
        CopyQueue(streams=0)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [2, 3, WHOLE_UPDATE_STREAMS])
def test_a_queue_lands_small_large_and_host_to_device_copies_on_cuda(streams):
    """Every copy lands, and what the current stream runs after `close` sees them all, even
    a side-stream copy that its side stream runs late."""
    sizes = [MEMCPY_BYTES + 5, 17, 4 * MEMCPY_BYTES, 256] * GROUP_MAX
    dsts, srcs = _pairs(sizes, "cuda")
    host_dst, host_src = torch.zeros(1000, dtype=torch.uint8, device="cuda"), \
        torch.arange(1000).to(torch.uint8)
    for side in _side_streams(dsts[0].device, streams - 1):
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # about 0.1 s on current GPUs: side streams lag
    queue = CopyQueue(streams=streams)
    for d, s in zip(dsts, srcs, strict=True):
        queue.add(d, s)
    queue.add(host_dst, host_src)
    queue.close()
    after = torch.empty_like(dsts[2])
    after.copy_(dsts[2])  # dsts[2] went to the first side stream (the current one had more
    # bytes queued)
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    assert torch.equal(host_dst.cpu(), host_src)
    assert torch.equal(after, srcs[2])


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [STREAMS, WHOLE_UPDATE_STREAMS])
@pytest.mark.parametrize("fenced", [True, False])
def test_a_fenced_queue_keeps_its_side_copies_behind_work_queued_between_them(fenced, streams):
    """The current stream reads destination B (a rollback snapshot, say) after a long kernel,
    between the queue's copy into A and its copy into B; B's copy goes to the side stream
    (fewer bytes queued there). Fenced, the snapshot sees B's old bytes; unfenced, the side
    copy runs during the kernel and the snapshot sees the new ones: the case `fenced` is for."""
    if not fenced and os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        pytest.skip("with CUDA_LAUNCH_BLOCKING=1 nothing overlaps: the race cannot happen")
    n = 8 * MEMCPY_BYTES
    dsts, srcs = _pairs([n, n], "cuda")
    dsts[1].fill_(7)
    snapshot = torch.empty(n, dtype=torch.uint8, device="cuda")
    queue = CopyQueue(fenced=fenced, streams=streams)
    queue.add(dsts[0], srcs[0])  # first group: on the current stream
    torch.cuda._sleep(200_000_000)  # about 0.1 s on current GPUs
    snapshot.copy_(dsts[1])
    queue.add(dsts[1], srcs[1])
    queue.add(torch.empty(n, dtype=torch.uint8, device="cuda"), srcs[0])  # fills the group
    queue.close()
    torch.cuda.synchronize()
    assert torch.equal(dsts[1], srcs[1])
    assert bool((snapshot == 7).all()) is fenced
