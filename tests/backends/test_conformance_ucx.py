"""The shipped conformance suite on the ucx backend (UCXX, real processes, host memory)."""

import pytest

from wtransfer.testing.conformance import BackendConformance

pytest.importorskip("ucxx", reason="UCXX is not installed (pip install 'wtransfer-ucx[cu12]')")


class TestUCXConformance(BackendConformance):
    backend = "ucx"
    workers = 2
