"""Errors a user fixes by changing their input; every layer of gjax may import this module.

`UserError` is the base of every error that a user can fix by changing what they passed in
(a flag, a config value, a data file, a path, a checkpoint of another run); its message says
what was wrong, where, and what to do. `gjax.cli.run` prints it as one paragraph and exits
with status 2; anything else is a bug in gjax and keeps its traceback. Subsystems derive their
own kinds (`DataError`, `CheckpointError`, ...) next to the code that raises them.
"""

from __future__ import annotations

import sys
import textwrap


class UserError(Exception):
    """An error the user fixes by changing their input; its message says what, where and how.

    `exit_now`: the process holds threads stuck on something outside it (storage that does
    not answer); after the paragraph the CLI exits at once instead of waiting for them."""

    exit_now = False


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the field and what to do."""


def format_user_error(err: BaseException) -> str:
    """The one-paragraph form of a user error: `gjax: <message>`, wrapped for a terminal."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    head = textwrap.fill(
        lines[0], width=100, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )
    return "\n".join([f"gjax: {head}", *lines[1:]])


def run_cli(main) -> None:
    """Runs a command's `main()`; a user error ends it with its one paragraph on stderr and
    exit status 2, never a traceback (tracebacks are for bugs)."""
    try:
        main()
    except UserError as e:
        print(format_user_error(e), file=sys.stderr, flush=True)
        sys.exit(2)
