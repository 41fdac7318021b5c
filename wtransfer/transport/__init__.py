"""The data plane every backend shares: the send and receive loops, liveness over TCP."""
