import sys

from loadtests.bench_sim.cli import main

main(sys.argv[1:])
