"""`python -m wtransfer ...` is the command-line interface (see `wtransfer.cli`)."""

from wtransfer.cli import main

if __name__ == "__main__":
    main()
