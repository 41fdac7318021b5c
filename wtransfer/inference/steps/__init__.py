"""The step loop: sequences, the scheduler (which owns pause), KV blocks, the runner that lays
out and runs one forward, and CUDA graphs for decode steps."""
