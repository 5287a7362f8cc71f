"""SIGTERM and Ctrl-C stop the loop at the end of a step; the same signal again exits at once."""

import os
import signal

import pytest

from gjax.stopping import on_stop_signal


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_asks_to_stop_and_the_second_is_left_to_the_default(signum, capsys):
    previous = signal.getsignal(signum)
    stop = {"signal": None}
    try:
        signal.signal(signum, lambda n, f: on_stop_signal(stop, n, f))
        os.kill(os.getpid(), signum)  # handled at the next bytecode boundary
        assert stop["signal"] == signum
        # A second one is not caught: the default action ends the process at once.
        assert signal.getsignal(signum) is signal.SIG_DFL
    finally:
        signal.signal(signum, previous)
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert f"{name}: finishing this step, then saving a checkpoint and exiting" in err
    assert "again exits at once, unsaved" in err
