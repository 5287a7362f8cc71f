"""Many episodes in flight: an environment's steps on an asyncio loop in a background thread.

The pattern of the reward pipeline (gjax.rewards.pipeline): `submit(episode, text)` schedules
one episode's step on the loop and returns a `concurrent.futures.Future` at once, so the
caller (later: the decoder, as each row finishes a turn) goes on decoding the other rows and
collects the step when it needs it. At most `max_in_flight` steps run at once (an asyncio
semaphore; the rest wait on the loop, not in the caller); the work inside them is bounded by
the environment's own pools (verifier workers, tool threads, sandbox children).

    with EnvRunner(env, max_in_flight=256) as runner:
        episodes = [runner.start(row) for row in rows]
        futures = [runner.submit(ep, text) for ep, text in zip(episodes, texts)]
        steps = [f.result() for f in futures]

`stats()`: `env/steps`, `env/in_flight` (now), `env/max_in_flight` (the most at once),
`env/step_s_sum` (seconds spent in steps, summed over episodes) and the environment's counters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gjax.envs.base import Environment, Episode, Step


class EnvRunner:
    """Runs episode steps of one environment concurrently (see the module docstring)."""

    def __init__(self, env: Environment, *, max_in_flight: int = 256):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.env = env
        self.max_in_flight = int(max_in_flight)
        self._lock = threading.Lock()
        self._counts = {"steps": 0, "in_flight": 0, "max_in_flight": 0, "step_s_sum": 0.0}
        self._closed = False
        self._pending: set[concurrent.futures.Future] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="gjax-env-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        self._slots = asyncio.run_coroutine_threadsafe(self._make_semaphore(), self._loop).result()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.max_in_flight)

    def start(self, row: Mapping[str, Any]) -> Episode:
        """A new episode of the environment for `row`."""
        return self.env.start(row)

    async def _step(
        self, episode: Episode, text: str, length: int | None, seconds: list | None
    ) -> Step:
        async with self._slots:
            with self._lock:
                self._counts["in_flight"] += 1
                self._counts["max_in_flight"] = max(
                    self._counts["max_in_flight"], self._counts["in_flight"]
                )
            t0 = time.perf_counter()
            try:
                return await episode.step(text, length=length)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self._counts["in_flight"] -= 1
                    self._counts["steps"] += 1
                    self._counts["step_s_sum"] += dt
                    if seconds is not None:
                        seconds.append(dt)

    def submit(
        self,
        episode: Episode,
        text: str,
        *,
        length: int | None = None,
        seconds: list[float] | None = None,
    ) -> concurrent.futures.Future:
        """Schedules `episode.step(text, length=length)`; a future of its `Step` (it raises
        only for a bug). `seconds`: the caller's list, which gets the step's seconds when it
        ends (a caller's own figure; `stats()` sums every caller's steps: an asynchronous
        run's producer thread and the loop thread's held-out evaluation share a runner)."""
        if self._closed:
            raise RuntimeError("EnvRunner is closed")
        step = self._step(episode, text, length, seconds)
        future = asyncio.run_coroutine_threadsafe(step, self._loop)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def step(
        self,
        episodes: Sequence[Episode],
        texts: Sequence[str],
        lengths: Sequence[int] | None = None,
    ) -> list[Step]:
        """One step of each episode, all in flight together; the steps in order."""
        lengths = [None] * len(texts) if lengths is None else list(lengths)
        if not len(episodes) == len(texts) == len(lengths):
            raise ValueError(
                f"{len(episodes)} episodes, {len(texts)} texts and {len(lengths)} lengths"
            )
        futures = [self.submit(e, t, length=n) for e, t, n in zip(episodes, texts, lengths)]
        return [f.result() for f in futures]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {f"env/{k}": float(v) for k, v in self._counts.items()}
        out.update(self.env.stats())
        return out

    def close(self) -> None:
        """Cancels steps still in flight (their futures raise CancelledError), stops the loop
        and closes the environment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            f.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self.env.close()

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
