"""Weight updates inside the engine: the replica (one copy of the model and its receiver),
staging and commits, rollback, each worker's shard of an update, LoRA adapters, release of
device memory."""
