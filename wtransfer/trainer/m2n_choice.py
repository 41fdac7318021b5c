"""Whether an update goes M->N: every trainer rank sending the workers its own shards (nothing
gathered), or one sender slicing what each worker keeps (1->N). A backend asks these at
connect, with what the sender base holds."""

from __future__ import annotations

import logging

from wtransfer.errors import ConfigError
from wtransfer.protocol import WeightSyncClient
from wtransfer.trainer.group import Ranks
from wtransfer.trainer.source import WeightSource
from wtransfer.trainer.updates import Updates, sends_whole

log = logging.getLogger("wtransfer.trainer")


def m2n_wanted(ranks: Ranks, source: WeightSource, requested: bool | None) -> bool:
    """Whether updates go M->N: when asked, or by default (`requested` None) when the source
    is sharded, every trainer rank has a client and every rank holds one box of each tensor
    (placements such as FSDP2 over a tensor-parallel dimension gather instead); asked without
    every rank having a client is refused (`ConfigError`)."""
    group = ranks.group
    everyone = group is None or len(group.senders) == group.size
    if requested and not everyone:
        assert group is not None
        raise ConfigError(f"m2n=True sends every trainer rank's own shards, but only "
                          f"{len(group.senders)} of {group.size} ranks have a client; "
                          "give every rank a client (only the first makes control calls)")
    if requested is None:
        return everyone and source.sharded and _one_box_per_rank(source)
    return requested


def _one_box_per_rank(source: WeightSource) -> bool:
    """Whether this rank holds one box of each tensor (what an M->N plan pairs); the
    placements are the same on every rank, so every rank answers alike."""
    try:
        source.layouts(0)
    except ConfigError as exc:
        log.warning("updates gather each bucket instead of going M->N: %s", exc)
        return False
    return True


def may_slice_per_worker(collective: bool, source: WeightSource, updates: Updates,
                         client: WeightSyncClient | None) -> bool:
    """Whether one sender may send each worker only what it keeps (1->N): a lone sender
    (not `collective`) whose every update sends a whole source (`sends_whole`) into more
    than one worker."""
    return (not collective and not source.sharded and sends_whole(updates, source)
            and client is not None and client.num_workers() > 1)
