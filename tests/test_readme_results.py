"""scripts/readme_results.py: the README's results block is the script's output, rewritten
only with --write."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import readme_results as rr  # noqa: E402

META = {
    "date": "2026-11-23",
    "machine": {
        "cpu": "Some CPU",
        "cores": 2,
        "jax": "0.10.2",
        "python": "3.11.7",
        "loadavg_1min_at_start": 0.1,
    },
    "overrides": [],
}


def result(config, before, mid, after, wall_s, mid_step=40, steps=120):
    return dict(
        config=config,
        before=before,
        mid=mid,
        after=after,
        wall_s=wall_s,
        mid_step=mid_step,
        steps=steps,
        heldout_size=256,
    )


def test_table_rows_and_readme_command_line():
    block = rr.table(
        [
            result("grpo", 0.51171875, 0.72265625, 0.70703125, 142.4),
            result("dagrpo", 0.51171875, None, 0.7421875, 61.0),
            result("a_grae", 0.51171875, None, 0.71484375, 101.6, mid_step=None),
        ],
        META,
    )
    lines = block.splitlines()
    assert lines[0].startswith("Measured 2026-11-23 by `python scripts/readme_results.py` on 2")
    assert "| config | before | step 40 | after 120 steps | wall |" in lines
    assert "| `grpo` | 0.512 | 0.723 | 0.707 | 2m22s |" in lines
    assert "| `dagrpo` (rule judge, 1 anchor per group) | 0.512 | - | 0.742 | 1m01s |" in lines
    assert " ".join(block.split()).endswith(
        "The README command as written (`a_grae.py:tiny`, no intermediate evaluations) takes "
        "1m42s: 0.512 -> 0.715."
    )
    assert all(len(ln) <= rr.WIDTH for ln in lines if not ln.startswith("|"))  # README's width


def test_rewrite_replaces_only_the_marked_block(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rr.BEGIN}\nold table\n{rr.END}\nrest\n")
    rr.rewrite_readme(str(readme), "new table")
    assert readme.read_text() == f"intro\n{rr.BEGIN}\n\nnew table\n\n{rr.END}\nrest\n"
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(SystemExit) as exc:
        rr.rewrite_readme(str(tmp_path / "bare.md"), "x")
    assert exc.value.code == 2
    assert "has no <!-- readme_results:begin -->" in capsys.readouterr().err


def test_unknown_config_is_a_user_error(capsys):
    with pytest.raises(SystemExit) as exc:
        rr.main(["--configs=grpo,nope"])
    assert exc.value.code == 2
    assert "unknown config(s) ['nope']" in capsys.readouterr().err


def test_readme_is_rewritten_only_with_write(tmp_path, monkeypatch, capsys):
    """By default the block is printed and saved under --root; README.md changes only with
    --write (the runs themselves replaced by a canned result: the table is what is tested)."""
    canned = result("grpo", 0.51171875, 0.72265625, 0.70703125, 142.4)
    monkeypatch.setattr(rr, "run_one", lambda *a, **k: dict(canned))
    readme = tmp_path / "README.md"
    original = f"intro\n{rr.BEGIN}\nold table\n{rr.END}\nrest\n"
    readme.write_text(original)
    root = tmp_path / "root"
    args = ["--configs=grpo", "--no-readme_command", f"--root={root}", f"--readme={readme}"]
    rr.main(args)
    assert readme.read_text() == original
    err = capsys.readouterr().err
    assert "| `grpo` | 0.512 | 0.723 | 0.707 | 2m22s |" in err
    assert f"{readme} left alone" in err and "--write" in err
    block = (root / "readme_block.md").read_text()
    assert "| `grpo` | 0.512 | 0.723 | 0.707 | 2m22s |" in block
    rr.main([*args, "--write"])
    assert readme.read_text() == f"intro\n{rr.BEGIN}\n\n{block}\n{rr.END}\nrest\n"
    with pytest.raises(SystemExit) as exc:
        rr.main([*args, "--write", "--readme="])
    assert exc.value.code == 2
    assert "--write needs a file" in capsys.readouterr().err


def test_the_readme_names_the_script_and_has_one_block():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert text.count(rr.BEGIN) == 1 and text.count(rr.END) == 1
    assert text.index(rr.BEGIN) < text.index(rr.END)
    assert "python scripts/readme_results.py --write" in text[: text.index(rr.BEGIN)]
