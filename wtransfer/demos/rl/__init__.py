"""A small async-RL loop on top of wtransfer: the task, a GRPO step, and the `make demo` run."""
