"""The soak test (`python -m loadtests.soak`): its load and its watch."""
