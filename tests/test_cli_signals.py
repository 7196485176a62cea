"""`specserve serve`'s SIGTERM handler: the first SIGTERM stops the server (as Ctrl-C does) and
every later one is ignored from that moment, so a second signal from an impatient supervisor
cannot land inside the drain or the stop and end them with a traceback. The whole CLI's stop is
tests/test_sigterm.py (a minute's start, run by make reliability)."""

import os
import signal

import pytest

from specserve.cluster.cli import Terminated, _raise_terminated


def test_the_first_sigterm_raises_and_any_later_one_is_ignored():
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)   # ignored: nothing raises, the process lives on
    finally:
        signal.signal(signal.SIGTERM, previous)
