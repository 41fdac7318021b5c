"""Delta updates: after a first full update, only the elements whose bits changed move.

    trainer (`trainer.deltas.DeltaSender`)          receiver (`receiver.deltas.DeltaTarget`)
    full update, token T0 ─────────────────────────> lands: holds base T0
    diff against its last-sent copy
    delta on base T0, token T1: header call ───────> holds T0? else `DeltaBaseError`, nothing
                                                     written; the sender sends in full
    changed tensors, each sparse or dense ─────────> applied onto the base; lands: holds T1

A delta travels as an ordinary update of a different tensor list (`wtransfer.delta.codec`):
each changed tensor either whole (dense) or as one uint8 payload of sorted element indices
followed by their new values (sparse), whichever is smaller; unchanged tensors are left out.
Every backend moves that list as it moves any other, so deltas need nothing of the backends.
The header (`DeltaHeader`, the update's first call after start) names the base the delta
applies to; receivers refuse one that does not match what they hold before any byte lands.

This package holds what both sides share: the codec, the comparison, M->N pieces and the
estimate. The strategies sit beside the bases that hold them: `wtransfer.trainer.deltas` and
`wtransfer.receiver.deltas` (their old names here still import, with a warning).
"""

from wtransfer import moved

moved.install("wtransfer.delta", {"sender": "wtransfer.trainer.deltas",
                                  "target": "wtransfer.receiver.deltas"})
