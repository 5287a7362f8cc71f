"""What every gjax command does with errors, help and noise.

`run(main)` runs an absl `main` and turns a `gjax.errors.UserError` (an error the user fixes
by changing what they passed in) into one short paragraph on stderr (what was wrong, where,
what to do) and exit status 2; anything else is a bug in gjax and keeps its traceback.

`run` parses the flags itself, so a flag or config-override mistake (an unknown flag, an
unknown `--config.x.y`, a value of the wrong type, a missing config file) is a `UserError`
too, reported before `main` starts. For a command with a config flag, `--help` also lists
every config field with its type, value and meaning (`gjax.schema.FIELDS`), and
`--print_config` prints that list alone; both exit 0.

Importing this module quiets what is expected on a CPU machine (jax's `Unable to initialize
backend 'tpu'`, transformers' `PyTorch was not found`, libraries' INFO lines); `--verbosity=0`
or higher shows library INFO again. Warnings stay.
"""

from __future__ import annotations

import logging
import os
import sys

# transformers prints advice (e.g. "PyTorch was not found. Models won't be available") at
# import; gjax never needs torch. Read when the advice is logged, so set before any import.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections.config_flags import config_flags  # noqa: E402

from gjax.errors import UserError, format_user_error  # noqa: E402
from gjax.schema import FIELDS, RENAMED, unknown_field  # noqa: E402

# Libraries whose INFO lines are noise in a gjax run (jax's backend probing on a machine
# without a TPU, orbax's per-save steps through absl, datasets' start-up notes).
QUIET_LOGGERS = ("absl", "jax", "datasets", "orbax")
_HELP_ARGS = ("--help", "-help", "-h", "--helpshort", "-helpshort", "-?")
_PRINT_CONFIG_ARGS = ("--print_config", "-print_config")


def _fail(err: BaseException) -> None:
    # The paragraph is the last word. A failed write leaves sibling failures in library
    # background tasks (orbax's asyncio writers); asyncio logs each one with a traceback when
    # the task is collected at exit. They repeat the reported cause, so logging stops here.
    logging.disable(logging.CRITICAL)
    print(format_user_error(err), file=sys.stderr, flush=True)
    if getattr(err, "exit_now", False):  # threads stuck on storage would hold the exit
        sys.stdout.flush()
        os._exit(2)
    sys.exit(2)


def quiet_libraries() -> None:
    """Library INFO lines off (warnings stay), unless --verbosity was given."""
    if "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].present:
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


# --------------------------------------------------------------------------- config flags


def _config_flags() -> list[str]:
    return [name for name, f in flags.FLAGS._flags().items() if config_flags.is_config_flag(f)]


def _given(name: str, argv: list[str]) -> str | None:
    """The value of `--name=v` / `--name v` in argv (the last one), or None."""
    value = None
    for i, arg in enumerate(argv):
        for prefix in (f"--{name}=", f"-{name}="):
            if arg.startswith(prefix):
                value = arg[len(prefix) :]
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def _overrides(name: str, argv: list[str]) -> list[str]:
    """The `--name.x.y=v` (or `--noname.x.y`) arguments, as given."""
    return [
        a
        for a in argv
        if a.lstrip("-").startswith(f"{name}.") or a.lstrip("-").startswith(f"no{name}.")
    ]


def load_config(name: str, value: str):
    """The ConfigDict of `--<name>=path[:arg]`, or a UserError saying why it cannot be built."""
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
        raise UserError(
            f"--{name}={value}: no config file {path!r} (relative to {os.getcwd()}). Name a "
            f"file of configs/, e.g. --{name}=configs/grpo.py:tiny."
        )
    try:
        config = config_flags.ConfigFileFlagParser(name, lock_config=False).parse(value)
    except (TypeError, ValueError) as e:
        # ml_collections folds the config's own error into a traceback text: keep its last line.
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise UserError(f"--{name}={value}: the config file rejected it: {last.strip()}") from None
    except (SyntaxError, ImportError) as e:
        raise UserError(f"--{name}={value}: the config file does not load: {e!r}") from None
    return config


def _leaves(cfg, prefix: str = ""):
    for key, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _diagnose(argv: list[str]) -> UserError | None:
    """Why parsing a config flag or one of its overrides failed, as a UserError (or None)."""
    for name in _config_flags():
        value = _given(name, argv)
        if value is None:
            continue
        try:
            config = load_config(name, value)
        except UserError as err:
            return err
        known = set(_leaves(config))
        sections = {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
        for arg in _overrides(name, argv):
            path = arg.lstrip("-").split("=", 1)[0].split(".", 1)[1]
            if path in RENAMED or path not in known | sections:
                # The flag, not its value: a value may be a secret pasted in the wrong place.
                flag = arg.split("=", 1)[0]
                return unknown_field(path, known, how=f" (from {flag})")
    return None


def _flag_error(err: Exception) -> UserError:
    msg = str(err).strip()
    if "Error whilst parsing config file" in msg:  # the config's get_config(arg) raised
        head = msg.split(": Error whilst parsing config file")[0]
        msg = f"{head}: {msg.splitlines()[-1].strip()}"
    end = "" if msg.endswith((".", "?", "!")) else "."
    fields = " and config fields" if _config_flags() else ""
    return UserError(f"{msg}{end} Run with --help to see the flags{fields}.")


def describe_config(config, fields: dict = FIELDS) -> str:
    """Every field of `config`: name, type, value and meaning, grouped as in the schema
    (`fields`: dotted path -> `gjax.schema.Field`)."""
    order = {path: i for i, path in enumerate(fields)}

    def parent_doc(path):  # objective.advantage_kwargs.eps -> objective.advantage_kwargs
        while path and path not in fields:
            path = path.rpartition(".")[0]
        return path

    paths = sorted(_leaves(config), key=lambda p: (order.get(parent_doc(p), len(order)), p))
    rows, section = [], None
    for path in paths:
        top = path.split(".")[0] if "." in path else ""
        if top != section:
            section = top
            rows.append(f"\n{top or '(top level)'}:")
        holder, _, key = path.rpartition(".")
        parent = config
        for k in holder.split(".") if holder else ():
            parent = parent[k]
        value = parent[key]
        kind = parent.get_type(key).__name__ if value is None else type(value).__name__
        field = fields.get(path)
        doc = field.doc if field else (fields[parent_doc(path)].doc if parent_doc(path) else "")
        valid = field.valid if field else None
        if path != parent_doc(path) and parent_doc(path):
            doc = f"{doc}: {key}"
        rng = f"; valid: {valid}" if valid is not None else ""
        rows.append(f"  {path:<34} {kind:<5} {value!r:<22} {doc}{rng}")
    return "\n".join(rows).lstrip("\n")


def _print_help(name: str | None, value: str | None, *, full: bool) -> None:
    main = sys.modules.get("__main__")
    if full:
        print((getattr(main, "__doc__", None) or "").strip() + "\n")
        print("flags:\n" + flags.FLAGS.main_module_help())
        print("\nTry --helpfull to get a list of all flags.")
    if name is None:
        return
    if value is None:
        print(f"\nGive --{name}=configs/<algo>.py[:tiny] to see its fields.")
        return
    config = flags.FLAGS[name].value  # with the overrides: the values the run would use
    print(
        f"\nconfig fields of --{name}={value} (override any with --{name}.<field>=<value>; "
        "valid: the checked range):\n"
    )
    print(describe_config(config))


def parse_flags(argv: list[str]) -> list[str]:
    """`absl.flags.FLAGS(argv)`, with every parsing mistake a UserError (one paragraph, exit
    2) and `--help` / `--print_config` listing the config's fields (exit 0)."""
    wants = None
    rest = []
    for i, arg in enumerate(argv):
        if arg == "--":
            rest += argv[i:]
            break
        if i and arg in _HELP_ARGS:
            wants = "help"
        elif i and arg in _PRINT_CONFIG_ARGS:
            wants = wants or "print_config"
        else:
            rest.append(arg)
    names = _config_flags()
    try:
        try:
            args = flags.FLAGS(rest)
        except flags.Error as err:
            if wants == "help":  # e.g. a required flag not given yet: help is what was asked
                _print_help(names[0] if names else None, None, full=True)
                sys.exit(0)
            raise (_diagnose(rest) or _flag_error(err)) from None
        except (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError):
            diagnosed = _diagnose(rest)
            if diagnosed is None:
                raise
            raise diagnosed from None
        for name in names:  # a config file that could not be read parses as a stand-in
            value = flags.FLAGS[name].value
            if value is not None and not isinstance(value, ml_collections.ConfigDict):
                load_config(name, flags.FLAGS[name].serialize().split("=", 1)[1])
        if wants:
            name = names[0] if names else None
            value = _given(name, rest) if name else None
            _print_help(name, value, full=wants == "help")
            sys.exit(0)
    except UserError as err:
        _fail(err)
    return args


def run(main) -> None:
    """`absl.app.run(main)`, with user errors printed as one paragraph and exit status 2."""

    def guarded(argv):
        # Here, not in parse_flags: absl sets its own logger's level from --verbosity after
        # parsing, before main.
        quiet_libraries()
        try:
            return main(argv)
        except UserError as err:
            _fail(err)

    app.run(guarded, flags_parser=parse_flags)
