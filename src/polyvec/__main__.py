import sys

try:
    from .entrypoints.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the command line: one line, as once it runs
    print("polyvec: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
