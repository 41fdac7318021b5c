"""M->N over one group: every trainer rank sends each worker the boxes it keeps.

At init every rank of the group (trainer ranks 0..M-1, then the workers) publishes what it
holds in the rendezvous store before it joins the group (`publish_layouts`): a trainer rank
its shards (`wtransfer.trainer.layouts`), a worker what it keeps (`WeightTarget.keeps`, or
every tensor whole). Once the group formed every key is there, so every rank reads them all
(`read_layouts`) and plans the same `wtransfer.transport.m2n.TransferPlan` for each tensor
list (`Planner`); the lead's update call carries the plan's digest, and a worker that planned
otherwise refuses the update before any byte moves.

A lone sender of a whole model leaves the choice to the layouts (`NCCLInitInfo.m2n_by_layouts`):
every worker publishes what it keeps first, the lead reads them and publishes its decision
(`publish_decision`: M->N where some worker keeps part of a tensor, else the broadcast), and
every worker joins the group that decision names (`read_decision`).

Each pair bucket is one point-to-point message: the sender packs its pieces from its own
shards (`LocalShards.pack_framed`), the worker receives them in its staging and writes each
box into place. Both sides walk their buckets in the plan's round order, so no rank ever
waits in a circle.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from wtransfer import wire
from wtransfer.errors import PeerError, TransferTimeout
from wtransfer.records import TensorLayout
from wtransfer.transport.m2n import (
    Planner,
    layouts_from_wire,
    layouts_to_wire,
    whole_layouts,
)

__all__ = ["Planner", "m2n_store", "publish_decision", "publish_layouts", "read_decision",
           "read_layouts", "whole_layouts"]

_KEY = "m2n/layouts/"
_DECISION = "m2n/decision"


def m2n_store(store: dist.Store) -> dist.Store:
    """The keys of the M->N group in a session's store."""
    return dist.PrefixStore("m2n/group/", store)


def publish_layouts(store: dist.Store, rank: int, layouts: dict[str, TensorLayout]) -> None:
    """Put what rank `rank` holds in the rendezvous (before it joins the group)."""
    store.set(f"{_KEY}{rank}", wire.encode(layouts_to_wire(layouts)))  # type: ignore[arg-type]


def read_layouts(store: dist.Store, ranks: range, timeout_s: float
                 ) -> list[dict[str, TensorLayout]]:
    """What each of `ranks` published, in rank order."""
    keys = [f"{_KEY}{rank}" for rank in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TransferTimeout(f"M->N: ranks {ranks.start}..{ranks.stop - 1} did not all publish "
                              f"their layouts within {timeout_s:g}s: {exc}") from None
    return [layouts_from_wire(wire.decode(bytes(store.get(key))), f"rank {rank}")
            for rank, key in zip(ranks, keys, strict=True)]


def publish_decision(store: dist.Store, m2n: bool | None, failure: str = "") -> None:
    """The lead's choice for a lone sender (M->N or the broadcast), read by every worker;
    None: the lead could not choose (`failure` says why)."""
    value = {True: "m2n", False: "broadcast", None: f"failed: {failure}"}[m2n]
    store.set(_DECISION, value.encode())  # type: ignore[arg-type]


def read_decision(store: dist.Store, timeout_s: float) -> bool:
    """Whether the lead chose M->N (`publish_decision`); `PeerError` when it could not."""
    try:
        store.wait([_DECISION], timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TransferTimeout(f"the trainer did not choose between M->N and the broadcast "
                              f"within {timeout_s:g}s: {exc}") from None
    value = bytes(store.get(_DECISION)).decode(errors="replace")
    if value.startswith("failed: "):
        raise PeerError(f"the trainer could not plan this transfer: {value[8:]}")
    return value == "m2n"
