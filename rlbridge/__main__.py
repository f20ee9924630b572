from rlbridge.cli import main

main()
