"""What every gjax command does with errors: a user's mistake is one paragraph, a bug a traceback.

`UserError` is the base of every error that a user can fix by changing what they passed in
(a config value, a data file, a path, a checkpoint of another run). `run(main)` runs an absl
`main` and turns a `UserError` into one short paragraph on stderr (what was wrong, where, what
to do) and exit status 2. Anything else is a bug in gjax and keeps its traceback.
"""

from __future__ import annotations

import sys
import textwrap

from absl import app


class UserError(Exception):
    """An error the user fixes by changing their input; its message says what, where and how."""


def format_user_error(err: BaseException) -> str:
    """The one-paragraph form of a user error: `gjax: <message>`, wrapped for a terminal."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    head = textwrap.fill(
        lines[0], width=100, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )
    return "\n".join([f"gjax: {head}", *lines[1:]]) if len(lines) > 1 else f"gjax: {head}"


def run(main) -> None:
    """`absl.app.run(main)`, with `UserError`s printed as one paragraph and exit status 2."""

    def guarded(argv):
        try:
            return main(argv)
        except UserError as err:
            print(format_user_error(err), file=sys.stderr, flush=True)
            sys.exit(2)

    app.run(guarded)
