"""wtransfer-ipc: same-host transfer by sharing staging memory instead of sending bytes.

CUDA tensors move through CUDA IPC handles of the sender's staging buffers (opened once per
buffer by each receiver and reused across updates); CPU tensors through POSIX shared memory.
"""

import wtransfer
from wtransfer import moved
from wtransfer_ipc.info import (
    CUDA_BUCKET_BYTES,
    CUDA_NUM_BUFFERS,
    IPCInitInfo,
    IPCTrainerInitInfo,
    IPCUpdateInfo,
)

BACKEND = wtransfer.Backend(
    name="ipc",
    receiver="wtransfer_ipc.receiver:IPCReceiver",
    sender="wtransfer_ipc.sender:IPCSender",
    summary="CUDA IPC / POSIX shared memory, same host",
)

__all__ = ["BACKEND", "CUDA_BUCKET_BYTES", "CUDA_NUM_BUFFERS", "IPCInitInfo", "IPCTrainerInitInfo",
           "IPCUpdateInfo"]

moved.install("wtransfer_ipc", {"mton": "m2n"})  # (M->N has one spelling: m2n)
