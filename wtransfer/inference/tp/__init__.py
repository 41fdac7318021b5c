"""Tensor parallelism of one engine replica: N worker processes that step together.

Rank 0 is the replica itself (`wtransfer.inference.updates.replica.Replica`): it owns the scheduler,
plans every forward and broadcasts the plan; ranks 1..N-1 are `worker` processes that compute
the same plan on their shards (`wtransfer.inference.model.parallel`). Every rank receives its own
shard of a weight update (`shard.ShardWeights`), through its own receiver.
"""
