"""`python -m stoker ...`: the same as the `stoker` command."""

from stoker.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
