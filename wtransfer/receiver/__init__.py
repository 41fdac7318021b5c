"""The engine side: the receiver base, one update's session, targets, the deadline timer."""
