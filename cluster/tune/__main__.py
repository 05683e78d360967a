import sys

from cluster.tune.cli import main

main(sys.argv[1:])
