"""What the controller costs in steady state, with the real host probe.

    python -m stress.bench_controller            # the benchmark's Llama at 2 x 512; also with every step measured
    python -m stress.bench_controller --proxy    # launch-bound: 24 small blocks, where host time is the step
    python -m stress.bench_controller --replan   # the host time of one replan of those 24 blocks
    python -m stress.bench_controller --parts    # on the proxy: what each part of the manager adds to a step

Two figures, over the same steady-state steps (shapes seen, plan held; one step in
`measure_every` to 32 times that is measured block by block, as in training):

  direct  the training thread's CPU time spent in the manager's own code, over the step's:
          every call the blocks make into it (block starts and ends, recompute marks, with
          the planning they trigger), its backward hooks, and
          `run_step` around the step function (the retry guard's copies, begin_step and
          end_step). A sum of small, exactly attributed times: stable from run to run.
          What adds to the step.
  background  the CPU time of its background thread (the pressure watch), over the step's:
          taken on another core, not from the step, but reported as what it costs.
  ab      a managed step against the same wrappers in the same modes with no manager
          watching, rotated, fastest of each. The honest end-to-end difference, but the
          difference of two noisy times (a few percent either way on a shared machine).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import torch

from stress.benchkit import batch_for, build
from stress.verdicts import at_most


def _thread_clock(thread: threading.Thread):
    """The CPU clock of another thread (Linux, macOS); None where there is none."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident)
    except (AttributeError, OSError, TypeError):
        return None
    return lambda: time.clock_gettime(clock)


class Timed:
    """Wraps callables so the CPU time of the calling thread spent inside them adds up in `spent`."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.thread_time() - t

        return timed


_WATCHED = ("block_start", "block_end", "recompute")
HOST_CHUNKS = 8  # stretches of steady steps whose host times give the host time's interval
HOST_MS_LINE = 1.0  # the manager's host time per steady step on 24 blocks
PROXY_LINE = 1.01  # a managed step against the same plan unmanaged


def _watch(ctl, timed: Timed) -> None:
    """Time every call the blocks make into the controller, and its backward hooks."""
    for name in _WATCHED:
        setattr(ctl, name, timed.wrap(getattr(ctl, name)))
    ctl.recorder._bwd_boundary = timed.wrap(ctl.recorder._bwd_boundary)


def _unwatch(ctl) -> None:
    for name in _WATCHED:
        delattr(ctl, name)
    del ctl.recorder._bwd_boundary


class _Small(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class LaunchBound(torch.nn.Module):
    """Many small blocks on small tensors: a step is mostly the host issuing ops, as on a GPU at
    batch 1, so whatever the controller does on the host shows in full."""

    def __init__(self, blocks: int = 24, width: int = 32) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Small(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _steady_proxy(blocks: int, warm: int):
    """(the proxy, its step function, its manager after `warm` managed steps); close the manager."""
    import adaptmem

    torch.manual_seed(0)
    model, x = LaunchBound(blocks), torch.randn(2, 8, 32)

    def work():
        model(x).backward()

    mem = adaptmem.manage(model, device="cpu", budget="95%")
    try:
        for _ in range(warm):
            mem.run_step(work)
            model.zero_grad(set_to_none=True)
    except BaseException:
        mem.close()
        raise
    return model, work, mem


def launch_bound(blocks: int = 24, steps: int = 2000, rounds: int = 7, round_steps: int = 50) -> dict:
    """The manager's host time per steady step (ms), over `steps` steps (long enough for the measuring
    period to stretch as it does in training: one step in 10 to 320 is measured block by block), then
    a managed step against the same plan with no manager watching (paired medians over `rounds` rotated
    rounds of `round_steps` each), through `run_step` and through `step()`. Beside those, what a user
    sees: the same wrappers with no manager against the model without adaptmem ("wrappers"), and a
    managed `run_step` against it ("adaptmem"): the same model with its blocks' wrappers taken off
    for its rounds (a twin made by copying ran 4% slower than the model itself)."""
    import statistics

    from adaptmem.wrapping import get_instrumentation

    model, work, mem = _steady_proxy(blocks, warm=8)  # past calibration: the plan is held
    try:
        runtime = get_instrumentation(model).runtime
        ctl = mem._controller
        own, inside = Timed(), Timed()
        _watch(ctl, own)
        timed_work = inside.wrap(work)
        spent, total = 0.0, 0.0
        chunks, chunk = [], max(1, steps // HOST_CHUNKS)
        for i in range(steps):
            worked, t = inside.spent, time.thread_time()
            mem.run_step(timed_work)
            took = time.thread_time() - t
            total += took
            spent += took - (inside.spent - worked)
            model.zero_grad(set_to_none=True)
            if (i + 1) % chunk == 0:  # the host time of each stretch of steps, for an interval
                chunks.append(own.spent + spent)
        _unwatch(ctl)
        host_ms = 1e3 * (own.spent + spent) / steps
        per_chunk = [1e3 * (b - a) / chunk for a, b in zip([0.0, *chunks], chunks)]

        def unmanaged():
            _unwatched(runtime, work)

        plain = _Bare(model, work)

        managed = lambda: mem.run_step(work)
        pairs = {
            "run_step": (managed, unmanaged),
            "step()": (lambda: _marked(mem, work), unmanaged),
            "wrappers": (unmanaged, plain),
            "adaptmem": (managed, plain),
        }
        ratios = {name: [] for name in pairs}
        for r in range(rounds):
            for name, pair in pairs.items():
                times = {}
                for fn in pair if r % 2 == 0 else pair[::-1]:
                    with plain.off() if fn is plain else contextlib.nullcontext():
                        t = time.perf_counter()
                        for _ in range(round_steps):
                            fn()
                            model.zero_grad(set_to_none=True)
                        times[fn] = time.perf_counter() - t
                ratios[name].append(times[pair[0]] / times[pair[1]])
    finally:
        mem.close()
    return {
        "blocks": blocks,
        "steps": steps,
        "host_ms": host_ms,
        "host_ms_chunks": per_chunk,
        "ratios": ratios,
        "step_ms": 1e3 * total / steps,
        **{name: statistics.median(r) for name, r in ratios.items()},
        "spread": {name: (min(r), max(r)) for name, r in ratios.items()},
    }


class _Bare:
    """A step of the managed model as if adaptmem were not there: inside `off()`, its blocks'
    wrappers are taken off (and put back after)."""

    def __init__(self, model: torch.nn.Module, work) -> None:
        from adaptmem.wrapping import get_instrumentation

        self.modules, self.work = [h.module for h in get_instrumentation(model).handles], work

    @contextlib.contextmanager
    def off(self):
        wrappers = [m.__dict__.pop("forward") for m in self.modules]
        try:
            yield
        finally:
            for m, w in zip(self.modules, wrappers):
                m.__dict__["forward"] = w

    def __call__(self) -> None:
        self.work()


def replan_ms(blocks: int = 24, repeats: int = 20, steady: int = 1000) -> dict:
    """How long one replan (`PlanBook.make`) of the proxy's steady shape takes on the host (ms, the
    fastest of `repeats`): as the first after the cost model learned (nothing kept from the plans
    before) and as one made again with nothing learned in between; and how many replans `steady`
    steps of it made ("replans")."""
    import adaptmem

    torch.manual_seed(0)
    model, x = LaunchBound(blocks), torch.randn(2, 8, 32)
    mem = adaptmem.manage(model, device="cpu", budget="95%")
    try:
        ctl = mem._controller
        for _ in range(30):
            mem.run_step(lambda: model(x).backward())
            model.zero_grad(set_to_none=True)
        made, make = [], ctl.plans.make
        ctl.plans.make = lambda *args, **kwargs: made.append(1) or make(*args, **kwargs)
        for _ in range(steady):
            mem.run_step(lambda: model(x).backward())
            model.zero_grad(set_to_none=True)
        del ctl.plans.make
        key, start = ctl.plans.bucket(2, 8 * 32), ctl.probe.allocated()
        took = {"after learning": [], "again": []}
        for _ in range(repeats):
            for name in took:
                if name == "after learning":  # what a step learned from drops: the kept latents, the pools
                    ctl.costs.load_state_dict(ctl.costs.state_dict())
                t = time.thread_time()
                ctl.plans.make(key, start, ctl.budget, fixed={}, reason="replan")
                took[name].append(1e3 * (time.thread_time() - t))
    finally:
        mem.close()
    return {**{name: min(times) for name, times in took.items()}, "replans": len(made), "steady": steady}


def parts(blocks: int = 24, rounds: int = 24, round_steps: int = 40, warm: int = 300) -> dict:
    """What each part of the manager adds to the proxy's steady step: the unmanaged step (the same
    wrappers in the same modes, no manager watching) with one part added, against it alone, in
    rotated rounds ({part: [ratio per round]}). The parts, each within the next:
      probe readings   the three readings of the probe a light step makes (its start, the first
                       block's, its peak at the end)
      recorder         the step recorder's begin and end around the step
      begin/end        the controller's begin_step and end_step (learning, deciding, the record)
      retry guard      run_step's guard alone (RNG, buffers, which gradients exist)
      step()           a marked step, its blocks watched (planning at the first block, the hook)
      run_step         the whole: the guard and a marked step"""
    from adaptmem.wrapping import get_instrumentation

    model, work, mem = _steady_proxy(blocks, warm)  # past calibration and the first measured steps
    try:
        runtime, ctl = get_instrumentation(model).runtime, mem._controller
        probe, recorder = ctl.recorder.probe, ctl.recorder

        def bare():
            _unwatched(runtime, work)

        def readings():
            probe.restart()
            probe.allocated()
            bare()
            probe.peak()

        def recorded():
            recorder.begin()
            bare()
            recorder.end()

        def begin_end():
            ctl.begin_step(None)
            bare()
            ctl.end_step()

        def guarded():
            guard = ctl.retries.guard(ctl.model, ctl.policy.accumulation_snapshot, ctl.policy.buffer_snapshot_limit)
            bare()
            guard.close()

        added = {
            "probe readings": readings,
            "recorder": recorded,
            "begin/end": begin_end,
            "retry guard": guarded,
            "step()": lambda: _marked(mem, work),
            "run_step": lambda: mem.run_step(work),
        }
        ratios: dict[str, list[float]] = {name: [] for name in added}
        for r in range(rounds):
            for name, fn in added.items():
                times = {}
                for f in (fn, bare) if r % 2 == 0 else (bare, fn):
                    t = time.perf_counter()
                    for _ in range(round_steps):
                        f()
                        model.zero_grad(set_to_none=True)
                    times[f] = time.perf_counter() - t
                ratios[name].append(times[fn] / times[bare])
    finally:
        mem.close()
    return ratios


def _marked(mem, work) -> None:
    with mem.step():
        work()


def controller_fraction(steps: int = 20, seq: int = 512, measure_every: int | None = None) -> dict:
    """{"direct", "ab", "background", "steps", "measured"}: the controller's share of a steady-state
    step, and the CPU its background thread takes beside it."""
    import adaptmem
    from adaptmem.wrapping import get_instrumentation

    model = build("llama")
    data = batch_for(2, seq)

    def work():
        model(**data).loss.backward()

    work()
    model.zero_grad(set_to_none=True)
    from adaptmem.config.policy import load_policy

    policy = load_policy()
    if measure_every is not None:
        policy = policy.model_copy(update={"measure_every": measure_every})
    mem = adaptmem.manage(model, device="cpu", budget="95%", policy=policy)
    try:
        for _ in range(6):  # past calibration: the plan is held
            mem.run_step(work)
            model.zero_grad(set_to_none=True)
        runtime = get_instrumentation(model).runtime
        own = Timed()
        _watch(mem._controller, own)
        sampler = _thread_clock(mem.sampler)
        stepped, measured, background, around = 0.0, 0, 0.0, 0.0
        inside = Timed()  # the step function's own time, which run_step wraps
        timed_work = inside.wrap(work)
        for _ in range(steps):
            s0 = sampler() if sampler else 0.0
            worked = inside.spent
            t = time.thread_time()
            mem.run_step(timed_work)
            took = time.thread_time() - t
            stepped += took
            around += took - (inside.spent - worked)  # the guard, begin_step and end_step
            background += (sampler() - s0) if sampler else 0.0
            measured += mem.last_step["measured"] == "blocks"
            model.zero_grad(set_to_none=True)
        _unwatch(mem._controller)
        direct = (own.spent + around) / stepped
        ab = _side_by_side(mem, model, work, runtime, max(6, steps // 2))
    finally:
        mem.close()
    return {"direct": direct, "ab": ab, "steps": steps, "measured": measured, "background": background / stepped}


def _unwatched(runtime, work) -> None:
    """One step through the same wrappers in the same modes, with no manager watching."""
    observer, runtime.observer = runtime.observer, None
    try:
        work()
    finally:
        runtime.observer = observer


def _side_by_side(mem, model, work, runtime, reps: int) -> float:
    managed, static = [], []
    for rep in range(reps):
        for which in (0, 1) if rep % 2 == 0 else (1, 0):
            t = time.process_time()
            if which == 0:
                with mem.step():
                    work()
                managed.append(time.process_time() - t)
            else:
                _unwatched(runtime, work)
                static.append(time.process_time() - t)
            model.zero_grad(set_to_none=True)
    return min(managed) / min(static) - 1


def main() -> int:
    torch.set_num_threads(1)
    if "--proxy" in sys.argv:
        got = launch_bound()
        print(
            f"launch-bound proxy, {got['blocks']} blocks, {got['steps']} steady steps: the manager's host time "
            f"{got['host_ms']:.2f} ms of a {got['step_ms']:.2f} ms step; managed against the same plan unmanaged: "
            f"run_step "
            f"{got['run_step']:.3f}x ({got['spread']['run_step'][0]:.3f}..{got['spread']['run_step'][1]:.3f}), "
            f"step() {got['step()']:.3f}x ({got['spread']['step()'][0]:.3f}..{got['spread']['step()'][1]:.3f})"
        )
        verdicts = [
            at_most(
                f"the manager's host time <= {HOST_MS_LINE:g} ms a steady step", got["host_ms_chunks"], HOST_MS_LINE
            ),
            *(
                at_most(f"{name}: managed <= {PROXY_LINE}x the same plan unmanaged", got["ratios"][name], PROXY_LINE)
                for name in ("run_step", "step()")
            ),
        ]
        print("\n".join(v.line() for v in verdicts))
        print(
            f"against the model without adaptmem: its wrappers alone {got['wrappers']:.3f}x "
            f"({got['spread']['wrappers'][0]:.3f}..{got['spread']['wrappers'][1]:.3f}), managed run_step "
            f"{got['adaptmem']:.3f}x ({got['spread']['adaptmem'][0]:.3f}..{got['spread']['adaptmem'][1]:.3f})"
        )
        return 0
    if "--parts" in sys.argv:
        import statistics

        from stress.verdicts import interval

        for name, ratios in parts().items():
            low, high = interval(ratios)
            print(f"{name:>15}: {statistics.median(ratios):.3f}x the unmanaged step [{low:.3f}, {high:.3f}]")
        return 0
    if "--replan" in sys.argv:
        got = replan_ms()
        print(
            f"a replan of 24 small blocks: after learning {got['after learning']:.2f} ms, again "
            f"{got['again']:.2f} ms; {got['replans']} replans in {got['steady']} steady steps"
        )
        return 0
    every = controller_fraction(measure_every=1)
    print(f"measuring every step block by block: {every['direct']:.3%} of a step in the controller's code")
    got = controller_fraction()
    print(
        f"controller: {got['direct']:.3%} of a steady-state step in its own code "
        f"(its background thread: {got['background']:.3%} of a step's CPU on another core; "
        f"{got['measured']} of {got['steps']} steps measured block by block); "
        f"side by side {got['ab']:+.2%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
