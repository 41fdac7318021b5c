"""`packing.gather_records` over a real gloo group of two ranks (two threads of this process):
every rank gets every rank's record, in rank order, in one collective when they all fit the
slot and in two when one does not."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from wtransfer.packing import RECORD_SLOT, gather_records

TIMEOUT = timedelta(seconds=30)


def gathered_by_two(records):
    """Each rank's result and how many collectives it ran, for `records[rank]`."""
    store = dist.HashStore()
    results, counts, errors = [None, None], [0, 0], []

    def rank(r):
        try:
            pg = dist.ProcessGroupGloo(store, r, 2, TIMEOUT)

            def all_gather(tensor):
                counts[r] += 1
                parts = [tensor.new_empty(tensor.shape) for _ in range(2)]
                pg.allgather([parts], [tensor]).wait()
                return parts

            results[r] = gather_records(records[r], all_gather)
        except Exception as exc:  # (reported below, with the rank)
            errors.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    return results, counts


def test_small_records_take_one_collective():
    records = [None, ["RuntimeError", "rank 1 failed: the reason"]]
    results, counts = gathered_by_two(records)
    assert results == [records, records]
    assert counts == [1, 1]


@pytest.mark.parametrize("big_rank", [0, 1])
def test_a_record_past_the_slot_takes_a_second_collective_on_every_rank(big_rank):
    big = {"pieces": list(range(RECORD_SLOT)), "name": "x" * RECORD_SLOT}
    records = [{"small": 1}, {"small": 2}]
    records[big_rank] = big
    results, counts = gathered_by_two(records)
    assert results == [records, records]
    assert counts == [2, 2]


def test_a_record_exactly_the_slot_fits_it():
    from wtransfer import wire
    payload = "y" * (RECORD_SLOT - len(wire.encode("")) - 2)
    while len(wire.encode(payload)) < RECORD_SLOT:
        payload += "y"
    assert len(wire.encode(payload)) == RECORD_SLOT
    results, counts = gathered_by_two([payload, b""])
    assert results == [[payload, b""], [payload, b""]]
    assert counts == [1, 1]
