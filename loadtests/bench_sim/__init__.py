"""The simulator's benchmarks (`python -m loadtests.bench_sim`): its report and its speed."""
