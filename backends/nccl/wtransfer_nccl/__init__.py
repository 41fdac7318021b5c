"""wtransfer-nccl: broadcast packed buckets from the trainer (rank 0) to every engine worker.

CUDA tensors go through NCCL itself (a ctypes binding to ``libnccl.so.2``, found at run time);
CPU tensors run the same protocol over gloo, so the whole backend works without a GPU.
Neither side needs ``torch.distributed``'s default process group.
"""

import wtransfer
from wtransfer import moved
from wtransfer_nccl.info import NCCLInitInfo, NCCLTrainerInitInfo, NCCLUpdateInfo

BACKEND = wtransfer.Backend(
    name="nccl",
    receiver="wtransfer_nccl.receiver:NCCLReceiver",
    sender="wtransfer_nccl.sender:NCCLSender",
    summary="NCCL broadcast to every worker (gloo for CPU tensors)",
)

__all__ = ["BACKEND", "NCCLInitInfo", "NCCLTrainerInitInfo", "NCCLUpdateInfo"]

moved.install("wtransfer_nccl", {"mton": "m2n"})  # (M->N has one spelling: m2n)
