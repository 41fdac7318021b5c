"""The demos behind `wtransfer demo` (async RL, in `rl/`) and `wtransfer transfer-demo`."""
