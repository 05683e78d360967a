import sys

from loadtests.calibrate.cli import main

main(sys.argv[1:])
