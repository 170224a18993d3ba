"""The pieces of `stress.bench`: models, a clock that counts link waits, the methods, the oracle.

Every method runs on its own copy of the model, on its own `SimulatedDevice` whose
host link has the speed under test. Step time is read from a `VirtualClock`: the
training thread's CPU time plus the time compute waited for the link. CPU time is
steadier than wall time on a shared machine, the link's waits are simulated time,
and other threads (other managers' samplers) are not counted, so neither a loaded
machine nor sleeping shows in the ratios.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import gc
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import adaptmem
from adaptmem import Mode
from adaptmem.testing import SimulatedDevice

ORACLE_MODES = (Mode.NONE, Mode.SELECTIVE, Mode.CHECKPOINT, Mode.OFFLOAD, Mode.CHECKPOINT | Mode.OFFLOAD)


def log(msg: str) -> None:
    """A benchmark's progress, on stderr (its results go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ models
def small_llama(vocab: int, *, layers: int, max_positions: int = 2048, dropout: float = 0.0) -> torch.nn.Module:
    """A Hugging Face Llama from a config (hidden 256, 8 heads, 4 KV heads; random weights): the
    stress scripts' model, by vocabulary, depth, longest position and attention dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        attention_dropout=dropout,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def build(name: str, device: str = "cpu") -> torch.nn.Module:
    """`tiny`: the project's small transformer; `llama`: a Hugging Face Llama from a config;
    `llama-1b`: TinyLlama-1.1B's shape with 8 of its 22 layers, for a GPU (bf16 there)."""
    torch.manual_seed(0)
    if name == "llama-1b":
        from stress.bench_modes import build as build_preset

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return build_preset("1b", VOCAB[name], device, dtype, num_hidden_layers=8)
    if name == "tiny":
        from adaptmem.demo.tiny import TinyConfig, TinyTransformer

        return TinyTransformer(TinyConfig(vocab_size=2048, dim=256, n_layers=8, n_heads=8, dropout=0.0)).to(device)
    if name == "llama":
        return small_llama(2048, layers=8, max_positions=4096).to(device)
    raise ValueError(f"unknown model {name!r}: tiny, llama or llama-1b")


VOCAB = {"tiny": 2048, "llama": 2048, "llama-1b": 32000}


def batch_for(batch: int, seq: int, vocab: int = 2048, device: str = "cpu") -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seq)).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------ time
def keep_host_memory() -> bool:
    """Keep freed host memory mapped for the rest of the process (glibc; False elsewhere).

    By default glibc maps a large tensor afresh on each allocation and unmaps it when it
    is freed, so every step takes thousands of page faults. Their cost depends on the
    allocator's history, not on the method under test: it added about 4% to a step and
    half the spread between repetitions. Kept mapped, host memory behaves as the CUDA
    caching allocator's device memory does. Call it once, before the first step.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


class VirtualClock:
    """CPU seconds of the calling thread plus the seconds compute spent waiting on the link."""

    def __init__(self) -> None:
        self.waited = 0.0

    def __call__(self) -> float:
        return time.thread_time() + self.waited

    def sleep(self, seconds: float) -> None:
        self.waited += seconds


def device_with_link(speed: float | None, capacity: int | None = None) -> tuple[SimulatedDevice, VirtualClock]:
    dev = SimulatedDevice(capacity_bytes=capacity, link_bytes_per_s=speed)
    clock = VirtualClock()
    if dev.link is not None:
        dev.link.clock, dev.link.sleep = clock, clock.sleep
    return dev, clock


# ------------------------------------------------------------------ methods
@dataclass
class Runner:
    """One method on its own model copy, device and clock."""

    method: str
    model: torch.nn.Module
    dev: SimulatedDevice
    clock: VirtualClock
    batch: dict
    budget_frac: float | None = None
    budget_bytes: int | None = None
    manager: object | None = None
    plan: tuple[Mode, ...] | None = None
    run: int = 1  # steps one reading covers, back to back (`GPU_RUN` on a GPU)
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    def _work(self) -> None:
        self.model(**self.batch).loss.backward()

    def step(self) -> float:
        """One training step (gradients cleared after), or `run` of them back to back; returns the
        seconds of one (their mean). The garbage collector runs before, not during: a collection
        of every method's objects would land in whichever step it happened to interrupt. Only the
        young generations: a full collection walks every object of the process (170 ms with
        transformers loaded); `stress.bench` runs one after each configuration."""
        gc.collect(1)
        gc.disable()
        try:
            start = self.clock()
            for _ in range(self.run):
                self.train_step()
            return (self.clock() - start) / self.run
        finally:
            gc.enable()

    def train_step(self) -> None:
        """One training step as a loop runs it, untimed: managed where there is a manager,
        gradients cleared after."""
        with self.dev:
            if self.manager is not None:
                self.manager.run_step(self._work)
            else:
                self._work()
            self.model.zero_grad(set_to_none=True)

    def measure_peak(self, steps: int = 1) -> int:
        """Peak device bytes over `steps` steps, read from the user's window (no manager reads it)."""
        for _ in range(steps):
            self.dev.reset_peak()
            self.step()
            self.peaks.append(self.dev.peak_bytes)
        return max(self.peaks[-steps:])

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def make_runner(
    method: str,
    base: torch.nn.Module,
    batch: dict,
    speed: float | None,
    *,
    plan=None,
    budget: tuple[float | None, int] | None = None,
    capacity: int | None = None,
    policy=None,
) -> Runner:
    """`method` on a copy of `base`: on its own stand-in with a link of `speed` bytes/s, or, where
    `base` lives on a GPU, on that device and its real link (`stress.benchkit_cuda`)."""
    on_gpu = next(base.parameters()).is_cuda
    run = 1
    if on_gpu:
        from stress.benchkit_cuda import GPU_RUN, CudaClock, CudaStage, shared_copy

        model, dev, clock, run = shared_copy(base), CudaStage(), CudaClock(), GPU_RUN
    else:
        model = copy.deepcopy(base)
        dev, clock = device_with_link(speed, capacity)
    dev.track(model)
    runner = Runner(method, model, dev, clock, batch, run=run)
    if method == "checkpoint_all":
        if hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable"):
            # the model's own (by either name transformers has given it): what users pick today
            from adaptmem.integrations.transformers import switch_own_checkpointing

            switch_own_checkpointing(model, True)
        else:
            adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    elif method == "offload_all":
        adaptmem.instrument(model, mode=Mode.OFFLOAD)
    elif method in ("oracle", "plan"):
        handles = adaptmem.instrument(model)
        for h, mode in zip(handles, plan):
            h.mode = mode
        runner.plan = tuple(plan)
    elif method == "adaptmem":
        runner.manager = adaptmem.manage(model, budget=budget[1], device=None if on_gpu else dev, policy=policy)
    if budget is not None:
        runner.budget_frac, runner.budget_bytes = budget
    return runner


# ------------------------------------------------------------------ oracle
@dataclass(frozen=True)
class ModeFigures:
    """One mode on every block: its step's peak and time."""

    peak: int
    seconds: float


def arrange(counts: dict[Mode, int], order: list[Mode]) -> tuple[Mode, ...]:
    """A plan with `counts[m]` blocks in each mode: the modes that save most on the first blocks
    (their bytes wait longest for backward), NONE last."""
    return tuple(itertools.chain.from_iterable([m] * counts.get(m, 0) for m in order))


def candidates(figures: dict[Mode, ModeFigures], blocks: int, budget: int, keep: int = 3) -> list[tuple[Mode, ...]]:
    """The `keep` plans predicted fastest among those predicted to fit `budget`.

    Per block a mode saves (peak_NONE - peak_mode) / blocks and costs (t_mode - t_NONE)
    / blocks, from the runs with every block in that mode; a plan is described by how
    many blocks take each mode.
    """
    none = figures[Mode.NONE]
    modes = list(figures)
    save = {m: (none.peak - f.peak) / blocks for m, f in figures.items()}
    cost = {m: (f.seconds - none.seconds) / blocks for m, f in figures.items()}
    order = sorted(modes, key=lambda m: -save[m])
    scored = []
    for split in _compositions(blocks, len(modes)):
        counts = dict(zip(modes, split))
        peak = none.peak - sum(save[m] * n for m, n in counts.items())
        seconds = sum(cost[m] * n for m, n in counts.items())
        scored.append((peak <= budget, seconds, peak, arrange(counts, order)))
    fitting = sorted((s for s in scored if s[0]), key=lambda s: s[1])
    if not fitting:  # nothing predicted to fit: the tightest ones
        fitting = sorted(scored, key=lambda s: s[2])
    return [s[3] for s in fitting[:keep]]


def _compositions(total: int, parts: int):
    """Every way of writing `total` as `parts` non-negative counts."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        bounds = (-1, *cuts, total + parts - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(parts))


def find_oracle(
    figures: dict[Mode, ModeFigures],
    blocks: int,
    budget: int,
    run: Callable[[tuple], Runner],
    steps: int,
    also: tuple[tuple[Mode, ...], ...] = (),
    finalists: int = 2,
) -> tuple[list[Runner], list]:
    """The fixed plans that fit and go on to the timed rounds, where `pick_oracle` takes the
    fastest: the fastest of the predicted best candidates and the plans in `also`, every plan
    of `also` that fits (adaptmem's: the oracle is never slower than the plan of the method it
    judges), and the next fastest up to `finalists` plans.

    The candidates that fit step in `steps` rotated rounds, every one once a round, and
    are ranked by their time against their round's mean, over the median round
    (`rotated_seconds`): run one after another, a slow spell on the shared machine would
    rank first whichever plan happened to run before it.
    """
    plans = candidates(figures, blocks, budget)
    plans += [tuple(p) for p in also if tuple(p) not in plans]
    tried, fitting = [], []
    for plan in plans:
        runner = run(plan)
        runner.step()  # warm-up
        peak = runner.measure_peak()
        if peak <= budget:
            fitting.append(runner)
        else:
            tried.append((plan_label(plan), peak, None))
    if not fitting:  # none measured within the budget: the all-CHECKPOINT plan, which is the floor
        best = run((Mode.CHECKPOINT,) * blocks)
        best.step()
        best.measure_peak()
        return [best], tried
    seconds = rotated_seconds(fitting, steps)
    tried += [(plan_label(r.plan), max(r.peaks), s) for r, s in zip(fitting, seconds)]
    ranked = [r for _, r in sorted(zip(seconds, fitting), key=lambda pair: pair[0])]
    kept = [ranked[0], *(r for r in ranked[1:] if r.plan in also)]  # the search's best and the judged plan
    kept += [r for r in ranked if r not in kept][: max(0, finalists - len(kept))]
    return kept, tried


def paired(times: list[float], against: list[float]) -> tuple[float, float]:
    """The median over repetitions of the ratio of two methods' times in the same round, and half
    the range of those ratios. Within a round the two ran minutes apart at most, so a slow spell
    of the machine slows both and cancels; the median drops a round one of them was unlucky in."""
    ratios = [t / b for t, b in zip(times, against)]
    return statistics.median(ratios), (max(ratios) - min(ratios)) / 2


def bootstrap_medians(ratios: list[float], rng: random.Random, draws: int) -> list[float]:
    """The median of `ratios` drawn again with replacement, `draws` times."""
    return [statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws)]


def paired_error(ratios: list[float], draws: int = 200) -> float:
    """The standard error of the median of `ratios` (a bootstrap, seeded)."""
    return statistics.pstdev(bootstrap_medians(ratios, random.Random(0), draws))


def settle(runner: Runner, against: Runner, line: float, most: int, batch: int = 4) -> tuple[list[float], list[float]]:
    """The two runners' times over the timed rounds and, while their paired ratio (`paired`) lies
    within two standard errors of `line`, over more rounds of the two alone (`batch` at a time,
    at most `most` in all): a verdict the timed rounds' noise leaves open is measured until it is
    not. The extra rounds are new draws, taken after the oracle was picked, so they also
    measure the picked plan without the luck that picked it."""
    mine, theirs = list(runner.times), list(against.times)
    while len(mine) < len(runner.times) + most:
        ratios = [a / b for a, b in zip(mine, theirs)]
        if abs(statistics.median(ratios) - line) > 2 * paired_error(ratios):
            break
        a, b = rotate([runner, against], batch)
        mine += a
        theirs += b
    return mine, theirs


def pick_oracle(finalists: list[Runner], against: list[float]) -> Runner:
    """Of the finalists, which stepped in the same timed rounds as the other methods, the one
    with the lowest median ratio to `against`'s time in the same round: the oracle."""
    best = min(finalists, key=lambda r: paired(r.times, against)[0])
    best.method = "oracle"
    return best


def rotate(runners: list[Runner], rounds: int) -> list[list[float]]:
    """Per runner, its step times in `rounds` rounds in which every runner steps once, each
    taking every position in turn."""
    times: list[list[float]] = [[] for _ in runners]
    for k in range(rounds):
        k %= len(runners)
        for i in [*range(k, len(runners)), *range(k)]:
            times[i].append(runners[i].step())
    return times


def rotated_seconds(runners: list[Runner], rounds: int) -> list[float]:
    """Per runner, its step time in `rounds` rotated rounds (`rotate`): the median over rounds of
    its time over the round's mean, times the mean of every time. A slow spell lands on a whole
    round and cancels."""
    times = rotate(runners, rounds)
    means = [statistics.mean(round_) for round_ in zip(*times)]
    overall = statistics.mean(means)
    return [overall * statistics.median(t / m for t, m in zip(ts, means)) for ts in times]


def plan_label(plan: tuple[Mode, ...]) -> str:
    """One letter per block: N, S, C, O; K for CHECKPOINT+OFFLOAD."""
    return "".join(m.label[0] if m is not (Mode.CHECKPOINT | Mode.OFFLOAD) else "K" for m in plan)
