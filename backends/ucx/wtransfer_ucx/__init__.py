"""wtransfer-ucx: packed buckets over UCX tagged messages, through UCXX.

UCX picks the transport itself (shared memory or CMA on one host, TCP, NVLink through cuda_ipc,
InfiniBand). ucx-py is archived upstream; its successor is UCXX, which this backend uses through
its synchronous low-level API with a progress thread, so the public API stays synchronous.
"""

import wtransfer
from wtransfer import moved
from wtransfer_ucx.info import UCXInitInfo, UCXTrainerInitInfo, UCXUpdateInfo

BACKEND = wtransfer.Backend(
    name="ucx",
    receiver="wtransfer_ucx.receiver:UCXReceiver",
    sender="wtransfer_ucx.sender:UCXSender",
    summary="UCX tagged messages via UCXX (shm, TCP, NVLink, IB)",
    requires=("ucxx",),
    install_hint="pip install ucxx-cu12 (or ucxx-cu13 for CUDA 13); from the clone: "
                 "pip install -e . -e 'backends/ucx[cu12]'",
)

__all__ = ["BACKEND", "UCXInitInfo", "UCXTrainerInitInfo", "UCXUpdateInfo"]

moved.install("wtransfer_ucx",  # (M->N has one spelling: m2n)
              {"mton": "m2n", "mton_reads": "m2n_reads"})
