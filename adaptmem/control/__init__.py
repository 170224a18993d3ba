"""The controller: what decides each block's mode, step by step.

manage.py      manage(): the one call users make
manager.py     MemoryManager: the public face (instruments the model, starts the controller, the API)
controller.py  Controller: one step's flow (begin, read, plan, apply, record, learn, decide), retries, pressure
blocks.py      ManagedBlocks: the blocks and the loss head, and the plan in force
stats.py       RunStats: the run's counts and figures
notices.py     the warnings given once per run
recorder.py    StepRecorder: a step cut at block boundaries, per-block measurements (or only its peak)
samples.py     BlockSample, StepSample, InputShape: what one step looked like
readings.py    SafeReadings: probe readings that never stop training
fits.py        Fit: one quantity as a function of the batch shape (least squares)
priors.py      Priors (named, with units and reasons) and one derivation per mode
costs.py       CostModel: per block and mode, bytes and seconds, learned from the run
timings.py     ModeTimes: the seconds part, each mode's own work (recompute, packing) read in its step
planner.py     pure: (options, capacity) -> the cheapest feasible plan, exact DP
plans.py       PlanBook: plans per shape bucket, calibration, static plans, retry plans
decisions.py   Decider: watermarks with hysteresis (a pure state machine)
budgeting.py   BudgetKeeper: the user's budget, shrunk under outside pressure, given back
retry.py       StepGuard (gradients, RNG, buffers), RetryGuard (a batch's attempts), the out-of-memory report
agreement.py   RankAgreement, Ranks: one plan for every rank, retries taken together
unfit.py       a batch no plan can fit: refused at once; Trace, what puts the controller back as before it
sampler.py     the background thread
events.py      the JSONL decision log
measure.py     measure_peak: the peak of a training step with every block in one mode
compiling.py   CompileCounter: torch.compile's compilations while a manager is open
headcosts.py   HeadCosts: the loss head's modes and chunk sizes as the plan's last row
resume.py      the controller's state_dict / load_state_dict, and summary()
"""
