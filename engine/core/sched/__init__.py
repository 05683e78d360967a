"""The scheduler's family (pure Python): the scheduler and its state, admission, preemption,
verified speculative rows, the decode cohort, the step launched ahead, policy order, step
totals, and the stats and checks read from outside."""
