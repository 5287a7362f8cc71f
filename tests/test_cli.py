"""The gjax CLIs: a user error is one paragraph and exit 2, --help lists every config field,
and a CPU machine's expected noise stays off while warnings stay on."""

import logging
import os
import subprocess
import sys

import pytest

from gjax import cli, schema
from gjax.errors import ConfigError, run_cli
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs gjax.train as `python -m` would, on a machine without torch (as a fresh `pip install
# gjax`): transformers then prints its "PyTorch was not found" advice at import.
NO_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; "
    "runpy.run_module('gjax.train', run_name='__main__', alter_sys=True)"
)


def gjax_train(*args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    env["PYTHONPATH"] = USER_PATH
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args, f"--workdir={tmp_path / 'wd'}"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_paragraph(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err and err.startswith("gjax: "), err[-3000:]
    assert len(err.strip().splitlines()) <= 5, err
    flat = " ".join(err.split())  # the paragraph is wrapped for a terminal
    for needle in needles:
        assert needle in flat, err
    # 14.7: nothing expected on a CPU machine is shown.
    assert "Unable to initialize backend" not in err and "PyTorch was not found" not in err


@pytest.mark.parametrize(
    "args, needles",
    [
        (  # a typo: rejected during flag parsing with gjax's message, not a 55-line traceback
            ["--config.train.stepz=3"],
            ["'config.train.stepz'", "Did you mean 'config.train.steps'", "num_iterations"],
        ),
        (  # a harmful value: rejected by validate in main, after jax picked its backend
            ["--config.optim.clip_norm=-1"],
            ["config.optim.clip_norm=-1.0 is out of range", "> 0"],
        ),
        (  # a renamed field: refused, naming the new one
            ["--config.reward.judge=openai"],
            [
                "config.reward.judge (from --config.reward.judge) was renamed",
                "config.reward.judge.name",
            ],
        ),
        (  # a name that was checked only after the model and the data had loaded
            ["--config.reward.functions=acuracy"],
            ["config.reward.functions", "'acuracy'", "'accuracy'"],
        ),
    ],
)
def test_user_errors_are_one_paragraph_exit_2(args, needles, tmp_path):
    proc = gjax_train("--config=configs/grpo.py:tiny", *args, tmp_path=tmp_path)
    assert_one_paragraph(proc, *needles)
    assert not (tmp_path / "wd").exists()  # nothing written before the config is known good


def test_help_and_print_config_list_every_field(tmp_path):
    proc = gjax_train(
        "--config=configs/grpo.py:tiny", "--config.optim.lr=0.0002", "--help", tmp_path=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "--workdir" in out and "--config" in out  # absl's flags are still listed
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for path, field in schema.FIELDS.items():
        doc, valid = field.doc, field.valid
        if path.endswith("_kwargs"):
            continue  # per-estimator: listed leaf by leaf (below)
        assert path in lines and doc in lines[path], path
        if valid is not None:
            assert f"valid: {valid}" in lines[path], path
    assert "hyperparameters of the advantage estimator" in lines["objective.advantage_kwargs.eps"]
    assert lines["optim.lr"].split()[1:3] == ["float", "0.0002"]  # the override applies
    assert lines["train.steps"].split()[1:3] == ["int", "120"]  # the tiny config's value
    assert out.index("\nmodel:") < out.index("\ndata:") < out.index("\noptim:")  # schema order
    assert "PyTorch was not found" not in proc.stderr
    proc = gjax_train("--config=configs/grpo.py:tiny", "--print_config", tmp_path=tmp_path)
    assert proc.returncode == 0 and "--workdir" not in proc.stdout
    assert [line for line in proc.stdout.splitlines() if line.startswith("  optim.lr ")]


def test_quiet_libraries_keeps_warnings():
    cli.quiet_libraries()
    for name in cli.QUIET_LOGGERS:
        logger = logging.getLogger(f"{name}.child")
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"


def test_user_error_paragraph():
    text = cli.format_user_error(cli.UserError("config.x: " + "long words " * 30 + "\nhint"))
    assert text.startswith("gjax: config.x: long words") and text.endswith("\nhint")
    assert all(len(line) <= 106 for line in text.split("\n"))  # wrapped for a terminal


def test_run_quiets_library_info_after_absl_sets_its_verbosity():
    # absl resets its own logger's level from --verbosity after parsing; run() quiets after.
    program = (
        "import logging\n"
        "from gjax import cli\n"
        "def main(argv):\n"
        "    logging.getLogger('absl').info('orbax says: a save step')\n"
        "    logging.getLogger('jax._src.xla_bridge').info('Unable to initialize backend tpu')\n"
        "    logging.getLogger('jax').warning('a real warning')\n"
        "    logging.getLogger('gjax').info('gjax speaks')\n"
        "    raise cli.UserError('config.x: bad; set it to y')\n"
        "cli.run(main)\n"
    )
    env = {**os.environ, "PYTHONPATH": USER_PATH}
    proc = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.endswith("gjax: config.x: bad; set it to y\n")
    assert "a real warning" in proc.stderr and "gjax speaks" in proc.stderr
    assert "orbax says" not in proc.stderr and "Unable to initialize" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-c", program, "--verbosity=0"], env=env, capture_output=True, text=True
    )
    assert "orbax says" in proc.stderr  # asked for: shown


@pytest.mark.parametrize(
    "module, args",
    [
        ("gjax.export", ["--workdir=gs://bucket/run", "--out=hf_out"]),
        ("gjax.export", ["--workdir=workdirs/run", "--out=gs://bucket/hf_out"]),
        ("gjax.eval", ["--checkpoint=gs://bucket/run", "--benchmarks=heldout"]),
        ("gjax.train", [f"--config={ROOT}/configs/grpo.py:tiny", "--workdir=gs://bucket/run"]),
    ],
)
def test_gs_paths_without_the_gcs_extra_name_the_install_line(module, args, tmp_path):
    """gcsfs made unimportable, as on an install without `.[gcs]`: one paragraph, exit 2."""
    no_gcsfs = (
        "import runpy, sys; sys.modules['gcsfs'] = None; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["PYTHONPATH"] = USER_PATH
    proc = subprocess.run(
        [sys.executable, "-c", no_gcsfs, *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_paragraph(proc, "pip install -e '.[gcs]'", "=gs://bucket/")


@pytest.mark.parametrize(
    "module, args",
    [
        ("gjax.train", ["--config.rollout.backend=jetstream"]),
        ("gjax.train", ["--config.rollout.backend=jetstream_grpc"]),
        ("gjax.serve", []),
    ],
)
def test_jetstream_missing_fails_before_the_model_loads(module, args, tmp_path):
    """JetStream made unimportable: one paragraph with the install line once, exit 2, at
    config validation (was: after the model loaded, with two install hints)."""
    import time

    no_jetstream = (
        "import runpy, sys; sys.modules['jetstream'] = None; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["PYTHONPATH"] = USER_PATH
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            no_jetstream,
            f"--config={ROOT}/configs/grpo.py:tiny",
            f"--workdir={tmp_path / 'wd'}",
            *args,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.perf_counter() - t0
    hint = (
        "pip install --no-deps google-jetstream==0.2.2 && "
        "pip install grpcio prometheus-client shortuuid tiktoken"
    )
    assert_one_paragraph(proc, hint, "needs JetStream")
    flat = " ".join(proc.stderr.split())
    assert flat.count("pip install") == 2  # the one hint (two commands joined by &&)
    assert "mesh" not in proc.stderr and not (tmp_path / "wd").exists()  # nothing set up
    assert elapsed < 60, elapsed


def test_run_cli_turns_a_user_error_into_one_paragraph_and_status_2(capsys):
    def main():
        raise ConfigError("no study 'x'; the studies: a, b")

    with pytest.raises(SystemExit) as exit_:
        run_cli(main)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "gjax: no study 'x'; the studies: a, b\n"
    run_cli(lambda: None)  # a command that succeeds returns
