"""What the restructuring promises a user: a lean import, checked definitions, one client
protocol that numbers each engine's workers, and remote errors that keep their kind."""

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest

import wtransfer
from wtransfer import errors
from wtransfer.control.clients import FanoutClient, SingleEngineClient


def test_importing_the_core_and_the_cli_pulls_no_server_demo_or_test_code():
    probe = ("import sys, wtransfer, wtransfer.cli, wtransfer_ipc, wtransfer_nccl;"
             "print(sorted(m for m in ('fastapi', 'uvicorn', 'httpx', 'matplotlib',"
             " 'wtransfer.testing', 'wtransfer.inference', 'wtransfer.demos')"
             " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_http_client_is_importable_from_the_top_level():
    from wtransfer.control.clients import HTTPClient

    assert wtransfer.HTTPClient is HTTPClient
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        wtransfer.NoSuchName  # noqa: B018


def test_a_trainer_init_info_without_a_backend_is_refused_when_defined():
    with pytest.raises(TypeError, match="must name its backend"):
        @dataclass(frozen=True, kw_only=True)
        class Nameless(wtransfer.TrainerInitInfo):
            pass

    @dataclass(frozen=True, kw_only=True)
    class Base(wtransfer.TrainerInitInfo, abstract=True):
        pass

    @dataclass(frozen=True, kw_only=True)
    class Named(Base):
        backend: ClassVar[str] = "ipc"

    assert Named(bucket_bytes=4096).backend == "ipc"


class Recorder(SingleEngineClient):
    """A client that records the init info its engine was given (the thing under test is
    FanoutClient's numbering, not a transport)."""

    def __init__(self, workers):
        self.workers = workers
        self.init_info = None

    def num_workers(self):
        return self.workers

    def init_weight_transfer_engine(self, init_info):
        self.init_info = init_info


def test_fanout_numbers_each_engines_workers_one_after_another():
    engines = [Recorder(2), Recorder(1), Recorder(3)]
    fanout = FanoutClient(engines)
    assert fanout.num_workers() == 6
    fanout.init_each_engine(lambda first, count: {"first": first, "count": count})
    assert [e.init_info for e in engines] == [{"first": 0, "count": 2},
                                               {"first": 2, "count": 1},
                                               {"first": 3, "count": 3}]
    fanout.close()


def test_a_client_reporting_a_bad_worker_count_is_named():
    fanout = FanoutClient([Recorder(0)])
    with pytest.raises(errors.ConfigError, match="num_workers=0"):
        fanout.num_workers()
    fanout.close()


@pytest.mark.parametrize(("kind", "family"), [
    ("LifecycleError", errors.LifecycleError), ("MetadataError", errors.MetadataError),
    ("ConfigError", errors.ConfigError), ("IntegrityError", errors.IntegrityError),
    ("TransferTimeout", errors.TransferTimeout), ("KeyError", errors.PeerError)])
def test_a_remote_failure_is_a_peer_error_of_the_same_kind(kind, family):
    exc = errors.from_reply({"ok": False, "type": kind, "message": "boom"}, "rank 3")
    assert isinstance(exc, errors.PeerError) and isinstance(exc, family)
    assert exc.remote_type == kind and str(exc) == f"rank 3: {kind}: boom"
