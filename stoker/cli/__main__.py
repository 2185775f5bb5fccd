"""`python -m stoker.cli ...`: the same as the `stoker` command (the supervisor re-executes it so)."""

from stoker.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
