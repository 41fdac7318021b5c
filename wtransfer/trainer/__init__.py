"""The trainer side: the sender base, what it sends, its calls, trainer-rank groups and gathers."""
