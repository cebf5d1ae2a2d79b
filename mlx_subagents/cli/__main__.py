"""`python -m mlx_subagents.cli`: the same entry point as the `subagent` script."""

from . import main

main()
