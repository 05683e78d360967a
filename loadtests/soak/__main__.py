from loadtests.soak.cli import main

main()
