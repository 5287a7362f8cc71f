"""The math-verify verifier: extraction, the answer table, adversarial inputs, the pool."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gjax.answers import (
    EXTRACTORS,
    extract_answer,
    extract_answer_tag,
    extract_boxed,
    extract_regex,
)
from gjax.rewards.verifier import Verifier, VerifierConfig, _sanitize, _to_parse_input

PAIRS = [
    json.loads(line)
    for line in (pathlib.Path(__file__).parent / "data" / "verifier_pairs.jsonl")
    .read_text()
    .splitlines()
    if line.strip()
]

# Outcome counters: every item lands in exactly one of them.
OUTCOME_KEYS = (
    "correct",
    "wrong",
    "no_answer",
    "refused",
    "parse_failures",
    "gold_parse_failures",
    "timeouts",
    "crashes",
)
ADVERSARIAL_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def verifier():
    """The pool for ordinary items: a generous deadline (the CPU is shared)."""
    with Verifier(VerifierConfig(timeout_s=20.0, num_workers=2)) as v:
        yield v


@pytest.fixture(scope="module")
def tight_verifier():
    """The pool for adversarial items: a tight deadline."""
    with Verifier(VerifierConfig(timeout_s=ADVERSARIAL_TIMEOUT_S, num_workers=2)) as v:
        yield v


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


def _wait_gone(pid, timeout_s=10.0):
    """Wait until ``pid`` has exited (gone, or a zombie its parent has yet to reap)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still running")


def _assert_accounted(stats):
    assert sum(stats[k] for k in OUTCOME_KEYS) == stats["calls"], stats


# ------------------------------------------------------------------ extraction (pure)


def test_boxed_last_balanced():
    assert extract_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{ {a}{b{c}} }") == "{a}{b{c}}"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"so \boxed 42.") == "42"
    assert extract_boxed(r"$\boxed 5$") == "5"
    assert extract_boxed(r"\boxed {3}") == "3"
    # Escaped braces inside the group do not count.
    assert extract_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    # An unbalanced (truncated) last box falls back to the previous complete one.
    assert extract_boxed(r"\boxed{3} then \boxed{\frac{1}{2}") == "3"
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None
    # Other commands that start with \boxed are not boxes.
    assert extract_boxed(r"\boxedsymbol{3}") is None
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{\\{1}") is None  # "\\" is an escaped backslash: { opens
    assert extract_boxed(r"\boxed{1}" + r"\boxed{" * 20_000) == "1"


def test_answer_tag_and_regex():
    assert extract_answer_tag("<answer>1</answer> x <answer> 2 </answer>") == "2"
    assert extract_answer_tag("<answer>1") is None
    assert extract_answer_tag("1</answer>") is None
    pat = re.compile(r"Answer:\s*(\S+)")
    assert extract_regex("Answer: 3 ... Answer: 4", pat) == "4"
    assert extract_regex("nothing", pat) is None
    assert extract_regex("x=5", re.compile(r"\d+")) == "5"


def test_extract_answer_order():
    text = r"<answer>1</answer> \boxed{2}"
    assert extract_answer(text, ("boxed", "answer_tag")) == ("2", "boxed")
    assert extract_answer(text, ("answer_tag", "boxed")) == ("1", "answer_tag")
    assert extract_answer("plain", ("boxed", "answer_tag")) == (None, None)
    assert extract_answer("plain 3", ("math_verify",)) == ("plain 3", "math_verify")
    with pytest.raises(ValueError, match="answer_regex"):
        extract_answer("x", ("regex",))
    assert set(EXTRACTORS.names()) >= {"boxed", "answer_tag", "math_verify"}


def test_parse_input_wrapping():
    assert _to_parse_input(r"\frac12") == r"\boxed{\frac12}"
    assert _to_parse_input(r"\$18") == r"\boxed{\$18}"  # an escaped dollar is a unit
    assert _to_parse_input("the answer is $5$") == "the answer is $5$"
    assert _to_parse_input(r"\(x\)") == r"\(x\)"


def test_sanitize_untrusted_text():
    assert _sanitize("abcdef", 3) == ("def", True)  # the tail survives truncation
    assert _sanitize("abc", 3) == ("abc", False)
    text, _ = _sanitize(b"\\boxed{\xff1}", 100)
    assert text == "\\boxed{\ufffd1}"
    text, _ = _sanitize("\\boxed{1\ud800}", 100)
    text.encode("utf-8")  # no lone surrogate left
    assert _sanitize(None, 5) == ("", False)


def test_config_fails_fast():
    with pytest.raises(ValueError, match="valid names: .*boxed"):
        VerifierConfig(extractors=("boxd",))
    with pytest.raises(ValueError, match="answer_regex"):
        VerifierConfig(extractors=("regex",))
    with pytest.raises(re.error):
        VerifierConfig(extractors=("regex",), answer_regex="(")
    with pytest.raises(ValueError, match="fork"):
        VerifierConfig(start_method="fork")
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierConfig(timeout_s=0)


# ------------------------------------------------------------------ the answer table


def test_table_is_large_and_mixed():
    assert len(PAIRS) >= 50
    assert sum(p["expected"] for p in PAIRS) >= 20
    assert sum(not p["expected"] for p in PAIRS) >= 20
    assert len({p["category"] for p in PAIRS}) >= 15
    # A row whose verdict differs from the mathematical truth must say why.
    for p in PAIRS:
        if p["expected"] != p["equivalent"]:
            assert p.get("note", "").startswith("SURPRISING"), p


def test_table(verifier):
    before = verifier.stats()
    outcomes = verifier.score_detailed([p["response"] for p in PAIRS], [p["gold"] for p in PAIRS])
    got = [o == "correct" for o in outcomes]
    bad = [
        (p["category"], p["gold"], p["response"][-40:], p["expected"], o)
        for p, g, o in zip(PAIRS, got, outcomes)
        if g != p["expected"]
    ]
    assert not bad, bad
    d = _delta(before, verifier.stats())
    assert d["calls"] == len(PAIRS) and d["correct"] == sum(p["expected"] for p in PAIRS)
    assert d["timeouts"] == d["crashes"] == 0


def test_score_dtype_and_counters(verifier):
    before = verifier.stats()
    responses = [
        r"\boxed{2}",  # correct
        r"\boxed{3}",  # wrong
        "no answer at all",  # no_answer
        r"\boxed{" + "1+" * 600 + "1}",  # refused: answer longer than max_answer_chars
        r"\boxed{2}",  # empty gold: gold parse failure, never sent to a worker
        r"\boxed{2}",  # gold math-verify cannot parse
        r"\boxed{\frac{}{}}",  # prediction math-verify cannot parse
    ]
    answers = ["2", "2", "2", "2", "  ", r"\frac{}{}", "2"]
    rewards = verifier.score(responses, answers)
    assert rewards.dtype == np.float32 and rewards.shape == (7,)
    np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0, 0, 0])
    d = _delta(before, verifier.stats())
    assert d["batches"] == 1 and d["calls"] == 7
    assert (d["correct"], d["wrong"], d["no_answer"], d["refused"]) == (1, 1, 1, 1)
    assert (d["gold_parse_failures"], d["parse_failures"]) == (2, 1)
    _assert_accounted(verifier.stats())
    assert verifier.score([], []).shape == (0,)


def test_programming_errors_raise(verifier):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        verifier.score(["a", "b"], ["1"])
    with pytest.raises(TypeError, match="not a string"):
        verifier.score("abc", "abc")


def test_ascore_matches_score(verifier):
    rows = PAIRS[:12]
    responses, answers = [p["response"] for p in rows], [p["gold"] for p in rows]
    boxed_answers = [r"\boxed{" + a + "}" for a in answers]

    async def main():
        # Two batches concurrently on one event loop; the loop is never blocked.
        return await asyncio.gather(
            verifier.ascore(responses, answers), verifier.ascore(boxed_answers, answers)
        )

    a, b = asyncio.run(main())
    np.testing.assert_array_equal(a, verifier.score(responses, answers))
    np.testing.assert_array_equal(b, np.ones(len(rows), np.float32))  # gold vs itself


def test_threads_match_serial(verifier):
    rows = PAIRS[::3]
    responses, answers = [p["response"] for p in rows], [p["gold"] for p in rows]
    serial = verifier.score(responses, answers)
    results, errors = {}, []

    def work(i):
        try:
            # Each thread scores a rotated copy, so items interleave differently.
            k = i % len(rows)
            out = verifier.score(responses[k:] + responses[:k], answers[k:] + answers[:k])
            results[i] = np.roll(out, k)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out in results.values():
        np.testing.assert_array_equal(out, serial)
    _assert_accounted(verifier.stats())


def test_created_and_used_off_the_main_thread():
    out = {}

    def work():
        with Verifier(num_workers=1, timeout_s=20.0) as v:
            out["r"] = v.score([r"\boxed{\dfrac{1}{2}}", r"\boxed{1}"], ["0.5", "2"])

    t = threading.Thread(target=work)
    t.start()
    t.join()
    np.testing.assert_array_equal(out["r"], [1.0, 0.0])


# ------------------------------------------------------------------ adversarial inputs

ADVERSARIAL = {
    "power_tower": r"The answer is \boxed{10^{10^{10^{10}}}}",
    "power_tower_2": r"\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
    "huge_factorial": r"\boxed{(10^{10})!}",
    "big_factorial": r"\boxed{9999999!}",
    "nested_braces": r"\boxed{" + "{" * 300 + "1" + "}" * 300 + "}",
    "nested_parens": r"\boxed{" + "(" * 400 + "2" + ")" * 400 + "}",
    "deep_braces_huge": r"\boxed{" + "{" * 200_000 + "1" + "}" * 200_000 + "}",
    "unbalanced_braces": r"\boxed{" * 100_000,
    "one_megabyte": ("lorem ipsum " * 90_000)[:1_000_000] + r" so \boxed{7}",
    "invalid_utf8": b"\\boxed{\xff\xfe\xc3(}",
    "lone_surrogates": "\\boxed{\ud800\udfff\ud800}",
    "many_boxes": r"\boxed{1}" * 50_000 + r"\boxed{" + "9" * 5000 + "}",
}
# These cannot finish inside any realistic deadline (10^(10^10) has 10^10 digits, ...).
MUST_TIME_OUT = ("power_tower", "huge_factorial")


def test_adversarial_items_score_zero_and_are_counted(tight_verifier):
    v = tight_verifier
    names = list(ADVERSARIAL)
    before = v.stats()
    t0 = time.perf_counter()
    outcomes = v.score_detailed([ADVERSARIAL[n] for n in names], ["1"] * len(names))
    elapsed = time.perf_counter() - t0
    by_name = dict(zip(names, outcomes))
    assert all(o != "correct" for o in outcomes), by_name
    for n in MUST_TIME_OUT:
        assert by_name[n] in ("timeout", "crash"), (n, by_name[n])
    assert by_name["deep_braces_huge"] in ("refused", "no_answer")  # refused before parsing
    assert by_name["many_boxes"] == "refused"
    assert by_name["unbalanced_braces"] == "no_answer"  # extraction is linear, not quadratic
    d = _delta(before, v.stats())
    assert d["calls"] == len(names)
    assert d["timeouts"] + d["crashes"] >= len(MUST_TIME_OUT)
    assert d["truncated"] >= 3  # the megabyte, the huge braces, the unbalanced boxes
    # Bounded: each item is cut at the deadline (plus a worker restart), two run at a time.
    # A liveness bound, deliberately loose: an unbounded item would take hours.
    assert elapsed < len(names) * (ADVERSARIAL_TIMEOUT_S + 5.0), elapsed
    _assert_accounted(v.stats())
    # The pool recovers: the next calls work, on fresh workers.
    np.testing.assert_array_equal(
        v.score([r"\boxed{\frac{1}{2}}", r"\boxed{3}", r"<answer>4</answer>"], ["0.5", "3", "5"]),
        [1.0, 1.0, 0.0],
    )
    assert all(pid is not None for pid in v.worker_pids())


def test_megabyte_response_keeps_its_tail(tight_verifier):
    big = "x" * 1_000_000 + r" \boxed{\frac{3}{4}}"
    np.testing.assert_array_equal(tight_verifier.score([big, big], ["0.75", "0.7"]), [1.0, 0.0])


def test_pathological_regex_is_bounded():
    # Catastrophic backtracking in a user pattern runs in the worker, under the deadline.
    cfg = VerifierConfig(
        extractors=("regex",), answer_regex=r"^(a+)+$", timeout_s=1.0, num_workers=1
    )
    with Verifier(cfg) as v:
        before = v.stats()
        out = v.score_detailed(["a" * 40 + "b", "aaa"], ["1", "1"])
        assert out[0] == "timeout"
        assert out[1] == "wrong"  # matched "aaa", which is not 1; the pool recovered
        assert _delta(before, v.stats())["timeouts"] == 1


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process, in clock ticks (/proc/PID/stat fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_worker_killed_while_busy_is_a_counted_crash():
    with Verifier(num_workers=1, timeout_s=60.0) as v:
        (pid,) = v.worker_pids()
        result = {}
        t = threading.Thread(
            target=lambda: result.update(r=v.score_detailed([ADVERSARIAL["power_tower"]], ["1"]))
        )
        t.start()
        deadline = time.monotonic() + 30
        while v.stats()["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # in_flight counts the item from its send; kill the worker only once it has read it
        # and computes (its CPU time grows), else the item sits unread, is sent again to a
        # new worker (test_worker_dead_between_items_is_replaced_silently): no crash.
        ticks = _cpu_ticks(pid)
        while _cpu_ticks(pid) < ticks + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        t.join(timeout=30)
        assert result["r"] == ["crash"]
        s = v.stats()
        assert s["crashes"] == 1 and s["worker_deaths"] == 1
        np.testing.assert_array_equal(v.score([r"\boxed{2}"], ["2"]), [1.0])
        assert v.worker_pids()[0] not in (None, pid)


def test_worker_dead_between_items_is_replaced_silently():
    with Verifier(num_workers=1, timeout_s=20.0) as v:
        (pid,) = v.worker_pids()
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        np.testing.assert_array_equal(v.score([r"\boxed{2}"], ["2"]), [1.0])
        s = v.stats()
        assert s["crashes"] == 0 and s["worker_deaths"] == 1 and s["worker_starts"] == 2


def test_workers_recycle_after_n_tasks():
    with Verifier(num_workers=1, timeout_s=20.0, max_tasks_per_worker=3) as v:
        pids = set()
        for i in range(7):
            pids.add(v.worker_pids()[0])
            assert v.score([rf"\boxed{{{i}}}"], [str(i)])[0] == 1.0
        pids.add(v.worker_pids()[0])
        s = v.stats()
        assert s["worker_recycles"] == 2 and s["worker_starts"] == 3
        assert len(pids - {None}) == 3


def test_close_is_final():
    v = Verifier(num_workers=1, timeout_s=20.0)
    pids = v.worker_pids()
    v.close()
    v.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        v.score([r"\boxed{1}"], ["1"])
    for pid in pids:
        _wait_gone(pid)


def test_worker_loop_reports_exceptions(monkeypatch):
    # The worker loop itself (run in a thread here): an exception in one item is reported as
    # an error reply and the loop goes on.
    import multiprocessing

    from gjax.rewards import verifier as vmod

    real = vmod._score_one

    def flaky(response, gold, *args):
        if response == "BOOM":
            raise RecursionError("maximum recursion depth exceeded")
        return real(response, gold, *args)

    monkeypatch.setattr(vmod, "_score_one", flaky)
    parent, child = multiprocessing.Pipe()
    t = threading.Thread(
        target=vmod._worker_main, args=(child, VerifierConfig(worker_memory_mb=None))
    )
    t.start()
    assert parent.recv() == ("ready", None)
    parent.send(("BOOM", "1"))
    assert parent.recv() == ("error", "RecursionError: maximum recursion depth exceeded")
    parent.send((r"\boxed{1}", "1"))
    assert parent.recv() == ("correct", None)
    parent.send(None)
    t.join(timeout=10)
    assert not t.is_alive()


def test_worker_exits_quietly_when_its_owner_is_gone():
    """An owner that dies with the worker's reply unread resets the connection: the worker
    ends without a traceback (seen when a study worker was stopped mid pass@k)."""
    import multiprocessing

    from gjax.rewards import verifier as vmod

    parent, child = multiprocessing.Pipe()
    raised = []

    def run():
        try:
            vmod._worker_main(child, VerifierConfig(worker_memory_mb=None))
        except BaseException as e:  # noqa: BLE001 (the assertion reports it)
            raised.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert parent.poll(30)  # "ready" is waiting, unread
    parent.close()
    t.join(timeout=10)
    assert not t.is_alive() and raised == []


def test_item_error_is_a_counted_crash_and_recycles(monkeypatch):
    from gjax.rewards import verifier as vmod

    real_run = vmod._Slot.run

    def run(self, payload, timeout_s):
        out = real_run(self, payload, timeout_s)
        return ("error", "RuntimeError: boom") if payload[0] == "BOOM" else out

    with Verifier(num_workers=1, timeout_s=20.0) as v:
        monkeypatch.setattr(vmod._Slot, "run", run)
        (pid,) = v.worker_pids()
        assert v.score_detailed(["BOOM", r"\boxed{1}"], ["1", "1"]) == ["crash", "correct"]
        s = v.stats()
        assert (s["crashes"], s["worker_errors"], s["worker_recycles"]) == (1, 1, 1)
        assert v.worker_pids()[0] != pid


def _child_scores(q):
    try:
        with Verifier(num_workers=1, timeout_s=ADVERSARIAL_TIMEOUT_S) as v:
            out = v.score([r"\boxed{1}", ADVERSARIAL["power_tower"]], ["1", "1"])
            q.put(("ok", out.tolist(), v.stats()["timeouts"]))
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        q.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_inside_a_child_process():
    # Deadlines work when the Verifier itself lives in a (non-daemonic) worker process; a
    # daemonic one (a multiprocessing.Pool worker) gets a clear error instead of a hang.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for daemon, expected in ((False, ("ok", [1.0, 0.0], 1)), (True, None)):
        q = ctx.Queue()
        p = ctx.Process(target=_child_scores, args=(q,), daemon=daemon)
        p.start()
        got = q.get(timeout=120)
        p.join(timeout=30)
        if expected is not None:
            assert got == expected
        else:
            assert got[0] == "error" and "daemonic process" in got[1], got


_OWNER_SCRIPT = r"""
import sys
from gjax.rewards.verifier import Verifier

if __name__ == "__main__":
    v = Verifier(num_workers=1, timeout_s=600.0, start_method=sys.argv[1])
    print(v.worker_pids()[0], flush=True)
    v.score([r"\boxed{9^{9^{9^9}}}"], ["1"])  # hours of SymPy: the owner is killed first
"""


def _cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_their_owner(tmp_path):
    """An owner SIGKILLed while its worker scores 9^{9^{9^9}}: the worker (and the forkserver)
    are gone within seconds, not after minutes of CPU; the item ran under an RLIMIT_CPU."""
    from gjax.rewards.verifier import _pid_alive

    script = tmp_path / "owner.py"
    script.write_text(_OWNER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    owner = subprocess.Popen(
        [sys.executable, str(script), "forkserver"], stdout=subprocess.PIPE, text=True, env=env
    )
    worker = None
    try:
        worker = int(owner.stdout.readline())
        with open(f"/proc/{worker}/stat") as f:
            forkserver = int(f.read().rsplit(")", 1)[1].split()[1])
        start = _cpu_ticks(worker)
        deadline = time.monotonic() + 60
        while _cpu_ticks(worker) - start < 20 and time.monotonic() < deadline:  # busy on it
            time.sleep(0.05)
        with open(f"/proc/{worker}/limits") as f:
            cpu = next(line for line in f if line.startswith("Max cpu time")).split()
        assert cpu[3] != "unlimited" and int(cpu[3]) <= 600 + 10 + 60, cpu  # soft limit set
        owner.kill()
        owner.wait()
        t0 = time.monotonic()
        while (_pid_alive(worker) or _pid_alive(forkserver)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not _pid_alive(worker), "verifier worker outlived its owner"
        assert not _pid_alive(forkserver), "forkserver outlived its owner"
    finally:
        owner.kill()
        owner.wait()
        if worker is not None and _pid_alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_CPU semantics")
def test_cpu_limit_ends_a_runaway_item_without_the_parent():
    """The RLIMIT_CPU backstop: a worker whose parent never kills it (here: nobody reads its
    pipe) dies of SIGXCPU about timeout_s + cpu_slack_s CPU seconds into the item."""
    import multiprocessing

    from gjax.rewards import verifier as vmod

    ctx = multiprocessing.get_context("forkserver")
    parent, child = ctx.Pipe(duplex=True)
    cfg = VerifierConfig(timeout_s=1.0, cpu_slack_s=0.0)
    proc = ctx.Process(target=vmod._worker_main, args=(child, cfg, os.getpid()), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(120) and parent.recv() == ("ready", None)
        parent.send((r"\boxed{9^{9^{9^9}}}", "1"))
        proc.join(timeout=60)
        assert proc.exitcode == -signal.SIGXCPU
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
