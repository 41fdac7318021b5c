"""The data plane every backend shares: the send and receive loops, liveness over TCP."""

from wtransfer import moved

moved.install("wtransfer.transport", {"mton": "m2n"})  # (M->N has one spelling: m2n)
