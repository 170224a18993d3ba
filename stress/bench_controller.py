"""What the controller costs in steady state, with the real host probe.

    python -m stress.bench_controller   # the benchmark's Llama at 2 x 512; also with every step measured

Two figures, over the same steady-state steps (shapes seen, plan held; one step in
`measure_every` is measured block by block, as in training):

  direct  the training thread's CPU time spent in the manager's own code, over the step's:
          every call the blocks make into it (`runtime.tell`: block starts and ends,
          recompute marks, with the planning they trigger), its backward hooks, and
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

import sys
import threading
import time

import torch

from stress.benchkit import batch_for, build


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
        tell, bwd = runtime.tell, mem._controller.recorder._bwd_boundary
        runtime.tell, mem._controller.recorder._bwd_boundary = own.wrap(tell), own.wrap(bwd)
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
        runtime.tell, mem._controller.recorder._bwd_boundary = tell, bwd
        direct = (own.spent + around) / stepped
        ab = _side_by_side(mem, model, work, runtime, max(6, steps // 2))
    finally:
        mem.close()
    return {"direct": direct, "ab": ab, "steps": steps, "measured": measured, "background": background / stepped}


def _side_by_side(mem, model, work, runtime, reps: int) -> float:
    managed, static = [], []
    for rep in range(reps):
        for which in (0, 1) if rep % 2 == 0 else (1, 0):
            t = time.process_time()
            if which == 0:
                with mem.step():
                    work()
                managed.append(time.process_time() - t)
            else:  # the same wrappers in the same modes, with no manager watching
                observer, runtime.observer = runtime.observer, None
                try:
                    work()
                finally:
                    runtime.observer = observer
                static.append(time.process_time() - t)
            model.zero_grad(set_to_none=True)
    return min(managed) / min(static) - 1


def main() -> int:
    torch.set_num_threads(1)
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
