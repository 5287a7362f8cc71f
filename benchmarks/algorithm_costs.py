"""What each algorithm costs per step, measured side by side in one process (issue 37 item 4).

    python benchmarks/algorithm_costs.py [--study all_algorithms] [--variants grpo,gpg,...]
        [--rounds 5] [--warmup 3] [--tiny]

Every variant of a study (`experiments/studies.py`: the studies' own configs, seed 0) is built
in this process through `gjax.train`'s pieces (`load_policy`, `build_rewards`, `make_backend`,
`build_learner`, `make_rollout`, `make_producer`) on one copy of the embedded policy's
weights each. After `--warmup` whole steps per variant (they compile the rollout and the
update's shapes), `--rounds` rounds time every variant twice, in an order that rotates each
round so that no variant always follows the same one:

- **learner**: `Learner.batch` (the reference's and any recomputed log-probs) and the update
  on one fixed rollout batch of that variant (the warm-up's last), blocked until done;
- **step**: one whole training step as `gjax.train` runs it (`producer.get`: sampling,
  rewards, the judge, anchors, DAPO's and GPG's extra rounds; then the learner), blocked.

One JSON line per variant: median seconds of each (and the spread over rounds), sampled
completion tokens and rollout rounds per step, the medians over the first variant's (the
ratios: what a reader compares, since this machine is noisy), and the learner's model FLOP/s
against this machine's measured f32 matmul FLOP/s (its physical floor here). A step whose
packing bins take a shape the variant has not met retraces the update (once per shape in a
run): the seconds jax spends tracing and compiling inside a timed window are subtracted
(`*_net_s`, the ratios' basis), and reported (`compile_s_in_timed`, `step_raw_s`). The last line
is the summary.

`--tiny`: the smoke study's variants, 2 prompts of 8 tokens, one packed shape, one round
(tests/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import studies  # noqa: E402
from gjax import flops, schema, sharding  # noqa: E402
from gjax.config import validate  # noqa: E402
from gjax.data.builders import build_prompt_data, run_data_config  # noqa: E402
from gjax.data.iterator import PromptIterator  # noqa: E402
from gjax.embedded import resolve_model_path  # noqa: E402
from gjax.learner import build_learner  # noqa: E402
from gjax.models import attention, hf_import, lora  # noqa: E402
from gjax.rewards.pipeline import build_rewards, build_verifier  # noqa: E402
from gjax.rollout.episodes import make_rollout  # noqa: E402
from gjax.rollout.factory import make_backend  # noqa: E402
from gjax.rollout.producer import make_producer  # noqa: E402

COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
    """Seconds jax spent tracing, lowering and compiling since `start()`."""

    def __init__(self):
        self.total = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.total += duration

    def since(self, mark: float) -> float:
        return self.total - mark


def _copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


class Arm:
    """One variant's training step, built as `gjax.train._train` builds it (no checkpoints,
    no held-out evaluation, no metrics file)."""

    def __init__(self, name: str, c, loaded, verifier, meshes, scope: contextlib.ExitStack):
        self.name, self.c = name, c
        model_cfg, params, tok = loaded
        mesh, rollout_mesh = meshes
        obj_cfg = schema.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
        self.obj_cfg = obj_cfg
        model_cfg, frozen, params = lora.attach(
            model_cfg, _copy(params), c.model.lora, mesh, jax.random.key(c.seed)
        )
        self.frozen = frozen
        self.policy = functools.partial(lora.merge, frozen)
        self.ref = None
        if obj_cfg.kl_beta > 0:
            self.ref = frozen if frozen is not None else _copy(params)
        rewards = scope.enter_context(build_rewards(c, verifier))
        backend = make_backend(c, model_cfg, self.policy(params), mesh=mesh, tokenizer=tok)
        scope.callback(backend.close)
        self.state, self.learner = build_learner(
            c,
            mesh=mesh,
            model_cfg=model_cfg,
            obj_cfg=obj_cfg,
            params=params,
            frozen=frozen,
            behaviour_logps=backend.returns_logps,
        )
        data = build_prompt_data(run_data_config(c), tok)
        it = PromptIterator(
            data, global_batch_size=c.rollout.prompts_per_step, seed=c.data.shuffle_seed
        )
        rollout = make_rollout(
            c,
            scope,
            model_cfg=model_cfg,
            backend=backend,
            tokenizer=tok,
            rewards=rewards,
            transfer=self.learner.transfer,
        )
        self.base_key = jax.random.key(c.seed)
        self.producer = make_producer(
            rollout=rollout,
            data_iter=it,
            params=self.policy(self.state.params),
            base_key=self.base_key,
            config=c,
            start=0,
            train_mesh=mesh,
            rollout_mesh=rollout_mesh,
            backend=backend,
            frozen=frozen,
        )
        scope.callback(self.producer.close)
        self.step = 0
        self.fixed = None  # a rollout batch for the learner-only timing
        self.model_cfg = model_cfg
        # Teacher-forced passes in `Learner.batch`: the reference's; the policy's own for
        # anchors or recomputed old log-probs.
        self.extra_forwards = (self.ref is not None) + bool(
            self.learner.recompute_old or self.learner.anchors
        )

    def _learn(self, groups) -> dict:
        """One update (a step of its own: the version the producer samples next moves on);
        returns its device batch."""
        batch = self.learner.batch(groups, self.policy(self.state.params), self.ref)
        key = jax.random.fold_in(jax.random.fold_in(self.base_key, self.step), 10_000)
        self.state, metrics = self.learner.update(self.state, batch, key, self.frozen)
        self.step += 1
        # The update donates the state: the producer samples the next step from these params.
        self.producer.push(self.policy(self.state.params), self.step)
        jax.block_until_ready((self.state, metrics))
        return batch

    def whole_step(self) -> dict:
        t0 = time.perf_counter()
        produced = self.producer.get(self.step)
        t1 = time.perf_counter()
        self._learn(produced.groups)
        t2 = time.perf_counter()
        self.fixed = produced.groups
        g = produced.groups
        return {
            "step_s": t2 - t0,
            "produce_s": t1 - t0,
            "completion_tokens": int(g.completion_mask_PxGxN.sum()),
            "sampled_tokens": produced.metrics.get("response/sampled_tokens"),
            "rounds": produced.metrics.get("sampling/rollouts"),
        }

    def learner_only(self) -> dict:
        g = self.fixed
        t0 = time.perf_counter()
        batch = self._learn(g)
        wall = time.perf_counter() - t0
        shapes = flops.learner_step_shapes(
            self.c.train, self.obj_cfg, self.learner, g, batch, extra_forwards=self.extra_forwards
        )
        impl = attention.platform_impl(self.model_cfg.attention)
        counted = flops.learner_flops(self.model_cfg, **shapes, attention_impl=impl)
        return {
            "learner_s": wall,
            "learner_model_flops": counted["useful"],
            "learner_executed_flops": counted["executed"],
        }


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", default="all_algorithms")
    ap.add_argument("--variants", default="", help="comma-separated; default: every variant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the smoke study, 1 round, 1 warm-up")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    if args.tiny:
        args.study, args.rounds, args.warmup = "smoke", 1, 1
    study = studies.get(args.study)
    names = [v.name for v in study.variants]
    if args.variants:
        names = [s.strip() for s in args.variants.split(",")]
    configs = {n: studies.build_config(study, study.variant(n), seed=0) for n in names}
    for c in configs.values():
        c.train.steps = args.warmup + 2 * args.rounds + 1  # the schedule's horizon
        c.log.eval_every = 0
        if args.tiny:  # one packed shape (a bin per row): one compile of the update
            c.rollout.prompts_per_step, c.rollout.max_new_tokens = 2, 8
            c.train.pack_bins = c.rollout.prompts_per_step * c.rollout.num_samples
    first = configs[names[0]]
    mesh_shape = validate(first, jax.device_count())
    peak = flops.measured_matmul_flops()
    print(
        json.dumps(
            {
                "what": "setup",
                "study": study.name,
                "variants": names,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "platform": jax.devices()[0].platform,
                "devices": jax.device_count(),
                "cpu_count": os.cpu_count(),
                "matmul_flops": peak,
                "P": first.rollout.prompts_per_step,
                "G": first.rollout.num_samples,
                "max_new_tokens": first.rollout.max_new_tokens,
                "minibatches": first.train.minibatches,
            }
        ),
        flush=True,
    )
    clock = CompileClock()
    mesh, rollout_mesh = sharding.make_meshes(mesh_shape, first.mesh.rollout_devices)
    with contextlib.ExitStack() as scope, jax.set_mesh(mesh), sharding.use_rules():
        path = resolve_model_path(first.model.path)
        model_cfg, params, tok = hf_import.load_policy(path, first.model, mesh)
        verifier = scope.enter_context(build_verifier(first))
        arms = []
        for n, c in configs.items():
            if c.model.to_dict() != first.model.to_dict():
                raise SystemExit(f"variant {n!r} has another model section: one load serves all")
            arms.append(Arm(n, c, (model_cfg, params, tok), verifier, (mesh, rollout_mesh), scope))
        for arm in arms:  # compile each variant's shapes before anything is timed
            for _ in range(args.warmup):
                arm.whole_step()
            arm.learner_only()
        rows = {a.name: [] for a in arms}
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                mark = clock.total
                learn = arm.learner_only()
                learn["learner_compile_s"] = clock.since(mark)
                mark = clock.total
                step = arm.whole_step()
                step["step_compile_s"] = clock.since(mark)
                # Net of compiling: a new packed shape retraces the update (once a run).
                learn["learner_net_s"] = learn["learner_s"] - learn["learner_compile_s"]
                step["step_net_s"] = step["step_s"] - step["step_compile_s"]
                rows[arm.name].append({**learn, **step})
    base = None
    summary = {"what": "summary", "baseline": names[0]}
    for name in names:
        got = rows[name]
        learner = _spread([x["learner_net_s"] for x in got])
        step = _spread([x["step_net_s"] for x in got])
        model_flops = statistics.median(x["learner_model_flops"] for x in got)
        executed = statistics.median(x["learner_executed_flops"] for x in got)
        if base is None:
            base = (learner["median"], step["median"])
        rec = {
            "what": "variant",
            "variant": name,
            "learner_net_s": learner,
            "step_net_s": step,
            "step_raw_s": _spread([x["step_s"] for x in got]),
            # producer.get: sampling, rewards, extra rounds (compiles included, if any)
            "produce_s": _spread([x["produce_s"] for x in got]),
            "learner_over_baseline": learner["median"] / base[0],
            "step_over_baseline": step["median"] / base[1],
            "learner_share_of_step": learner["median"] / step["median"],
            "completion_tokens_per_step": float(np.mean([x["completion_tokens"] for x in got])),
            "sampled_tokens_per_step": _mean_or_none([x["sampled_tokens"] for x in got]),
            "rollout_rounds_per_step": _mean_or_none([x["rounds"] for x in got]),
            # model FLOPs (useful: real tokens, MFU's) and executed (padding, remat: HFU's)
            "learner_model_flops_per_s": model_flops / learner["median"],
            "learner_over_matmul_floor": model_flops / learner["median"] / peak,
            "learner_executed_over_matmul_floor": executed / learner["median"] / peak,
            "compile_s_in_timed": sum(x["learner_compile_s"] + x["step_compile_s"] for x in got),
        }
        print(json.dumps(rec), flush=True)
        summary[f"{name}_learner_over_baseline"] = rec["learner_over_baseline"]
        summary[f"{name}_step_over_baseline"] = rec["step_over_baseline"]
    print(json.dumps(summary), flush=True)


def _mean_or_none(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


if __name__ == "__main__":
    main()
