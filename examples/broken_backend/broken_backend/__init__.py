"""Deliberately empty: the entry point names a module that does not exist."""
