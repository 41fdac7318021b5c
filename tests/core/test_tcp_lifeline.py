"""A trainer's lifeline (`wtransfer.transport.tcp_lifeline`): engines learn within moments
that the trainer process died, and never while it lives."""

import os
import signal
import subprocess
import sys

from wtransfer.transport.tcp_lifeline import Lifeline, LifelineListener

_TRAINER = ("from wtransfer.transport.tcp_lifeline import LifelineListener; import sys; "
            "listener = LifelineListener(); print(listener.port, flush=True); sys.stdin.read()")


def test_every_engine_sees_a_killed_trainer_at_once_and_a_live_one_never():
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        port = int(trainer.stdout.readline())
        lines = [Lifeline("127.0.0.1", port, 5.0) for _ in range(40)]
        assert all(line.active for line in lines)
        assert not lines[0].wait(0.3)  # a quiet trainer is not a dead one
        assert not any(line.gone() for line in lines)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        assert all(line.wait(10) for line in lines)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    for line in lines:
        line.close()
        assert not line.gone()  # closed: nothing left to tell


def test_a_closed_listener_resets_its_lifelines_and_an_unreachable_one_is_inert():
    """A trainer that shuts down closes its listener: the lifelines see it. A lifeline that
    cannot connect says why and never reports the trainer gone (only the deadline applies)."""
    listener = LifelineListener("127.0.0.1")
    line = Lifeline("127.0.0.1", listener.port, 5.0)
    assert line.active and not line.gone()
    listener.close()
    assert line.wait(10)
    inert = Lifeline("127.0.0.1", listener.port, 1.0)  # nobody listens there any more
    assert not inert.active and not inert.gone() and not inert.wait(0.1)
    assert inert.error is not None and f"127.0.0.1:{listener.port}" in inert.error


def test_a_trainer_address_this_host_does_not_hold_listens_on_every_interface():
    """Behind a NAT the trainer's address is not its own: the listener then takes every
    interface, so engines still reach it (here through loopback)."""
    listener = LifelineListener("192.0.2.7")  # TEST-NET-1: never a local address
    try:
        line = Lifeline("127.0.0.1", listener.port, 5.0)
        assert line.active and not line.gone()
        line.close()
    finally:
        listener.close()
