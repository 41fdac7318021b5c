"""The shipped conformance suite on the ucx backend (UCXX, real processes, host memory)."""

import pytest

from wtransfer.testing.conformance import BackendConformance

pytest.importorskip("ucxx", reason="UCXX is not installed (pip install 'wtransfer-ucx[cu12]')")


class TestUCXConformance(BackendConformance):
    backend = "ucx"
    workers = 2
    timeout_s = 10.0  # a UCX init (worker, listener, endpoints) once took over 5 s on the
    # 2-core VM while the whole suite ran beside it (20 in a row take 10 s alone)
