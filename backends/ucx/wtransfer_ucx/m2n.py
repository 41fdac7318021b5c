"""M->N over UCX: every trainer rank sends each worker the boxes it keeps, as tagged messages.

At init every trainer rank listens, and its init fragment carries its address and what it
holds (`wtransfer.transport.m2n.fragment_with_layouts`); the merged init info lists every
rank (`UCXInitInfo.trainers`). Each worker connects to every rank (so each side sees the
other leave) and sends each a hello: its index among all workers, its UCX worker address and
what it keeps. Once every worker is initialized, each rank reads every worker's hello (tagged
with the worker's index), opens an endpoint to each by its address (so it knows which
endpoint leads to which worker: tagged messages do not say where they came from) and plans;
the lead then sends each worker the roster, what every rank holds and every worker keeps,
from which the worker plans the same `TransferPlan` for each tensor list (`Planner`). The
lead's update call carries the plan's digest, and a worker that planned otherwise refuses
the update before any byte moves.

Each pair bucket is one tagged message, tagged with its position in the plan
(`TransferPlan.position`: no two buckets share one), so a worker's receives, posted in round
order, match the right rank's bucket whichever rank sends first. Both sides walk their
buckets in round order, a few ahead, so no rank waits on another in a circle.
"""

from __future__ import annotations

import time
from typing import Any

from wtransfer import wire
from wtransfer.errors import MetadataError
from wtransfer.records import TensorLayout
from wtransfer.transport.m2n import Planner, layouts_from_wire, layouts_to_wire
from wtransfer_ucx.transport import MAX_MESSAGE_BYTES, Outbox, UCXWorker, control_tag

_HELLO = 1
_ROSTER = 2


def hello(ucx: UCXWorker, ep: Any, session: int, worker: int,
          keeps: dict[str, TensorLayout]) -> Outbox:
    """Start telling the trainer rank at `ep` that this is worker `worker`, where to reach it
    and what it keeps."""
    return ucx.send_message(ep, wire.encode({"address": ucx.address(),
                                             "layouts": layouts_to_wire(keeps)}),
                            control_tag(session, _HELLO, worker))


def read_hellos(ucx: UCXWorker, session: int, workers: int, timeout_s: float
                ) -> tuple[list[Any], list[dict[str, TensorLayout]]]:
    """Every worker's hello: an endpoint to each and what each keeps, in worker order."""
    deadline = time.monotonic() + timeout_s
    endpoints, layouts = [], []
    for worker in range(workers):
        what = f"worker {worker}'s M->N hello"
        message = _decode(ucx.recv_message(control_tag(session, _HELLO, worker),
                                           deadline - time.monotonic(), what), what)
        address = message.get("address")
        if not isinstance(address, bytes) or not address:
            raise MetadataError(f"{what} carries no UCX worker address")
        layouts.append(layouts_from_wire(message.get("layouts"), f"worker {worker}"))
        endpoints.append(ucx.connect_to_address(address))
    return endpoints, layouts


def roster(ucx: UCXWorker, ep: Any, session: int, worker: int, planner: Planner) -> Outbox:
    """Start sending `worker` what every trainer rank holds and every worker keeps."""
    assert planner.dests is not None
    return ucx.send_message(ep, wire.encode({
        "trainers": [layouts_to_wire(s) for s in planner.sources],
        "workers": [layouts_to_wire(d) for d in planner.dests]}),
        control_tag(session, _ROSTER, worker))


def read_roster(ucx: UCXWorker, session: int, worker: int, timeout_s: float,
                bucket_bytes: int) -> Planner:
    """The planner of the roster the lead trainer rank sends `worker`."""
    what = "the M->N roster from trainer rank 0"
    message = _decode(ucx.recv_message(control_tag(session, _ROSTER, worker), timeout_s,
                                       what), what)
    sides = []
    for side in ("trainers", "workers"):
        ranks = message.get(side)
        if not isinstance(ranks, list) or not ranks:
            raise MetadataError(f"{what} lists no {side}")
        sides.append([layouts_from_wire(r, f"{side[:-1]} {i} (roster)")
                      for i, r in enumerate(ranks)])
    if worker >= len(sides[1]):
        raise MetadataError(f"{what} lists {len(sides[1])} workers; this is worker {worker}")
    return Planner(sides[0], sides[1], bucket_bytes)


def _decode(payload: bytes, what: str) -> dict[str, Any]:
    message = wire.decode(payload, max_bytes=MAX_MESSAGE_BYTES)
    if not isinstance(message, dict):
        raise MetadataError(f"{what} must be a mapping, got {type(message).__name__}")
    return message
