"""Stopping a run on request: SIGTERM (a preemption) or Ctrl-C finish the step, save, exit.

`install(stop)` routes both signals to `on_stop_signal`, which records the signal in the
`stop` dict the training loop polls at the end of each step, and resets that signal to its
default action, so the same signal a second time ends the process at once, unsaved.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable


def on_stop_signal(stop: dict, signum: int, frame) -> None:
    """SIGTERM / SIGINT: finish the step, save, exit. The same signal again exits at once."""
    del frame
    stop["signal"] = signum
    signal.signal(signum, signal.SIG_DFL)
    name = signal.Signals(signum).name
    print(
        f"\n{name}: finishing this step, then saving a checkpoint and exiting "
        f"({'Ctrl-C' if signum == signal.SIGINT else name} again exits at once, unsaved).",
        file=sys.stderr,
        flush=True,
    )


def install(stop: dict) -> Callable[[], None]:
    """From here on SIGTERM and SIGINT set `stop["signal"]` instead of ending the process;
    returns the function that puts the previous handlers back (a run inside a longer-lived
    process, e.g. a test, leaves them as it found them)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for signum in previous:
        signal.signal(signum, functools.partial(on_stop_signal, stop))

    def restore() -> None:
        for signum, handler in previous.items():
            if handler is not None:  # None: installed outside Python, not ours to restore
                signal.signal(signum, handler)

    return restore
