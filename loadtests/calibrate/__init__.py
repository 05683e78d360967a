"""Calibrating the cost model to this machine (`python -m loadtests.calibrate`) and replaying a
trace against it (`python -m loadtests.calibrate.replay`)."""
