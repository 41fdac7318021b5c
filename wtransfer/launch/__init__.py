"""Child processes for tests, benchmarks and demos: receivers, trainers, trainer ranks."""
