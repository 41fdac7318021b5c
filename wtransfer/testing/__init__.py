"""Tools for testing backends, shipped so third-party backends reuse them.

`wtransfer.testing.conformance.BackendConformance` is the backend conformance suite (a pytest
mixin); `models` builds realistic parameter lists; `processes` runs receivers and trainers in
real child processes.
"""
