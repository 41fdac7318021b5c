"""The data plane every backend shares: the send and receive loops, the control channel,
liveness over TCP, the device-checked kernels and the stack printer of its processes (the byte
copies are `wtransfer.copies`, in the base layer)."""

from wtransfer import moved

moved.install("wtransfer.transport", {"mton": "m2n",  # (M->N has one spelling: m2n)
                                      "copies": "wtransfer.copies"})
