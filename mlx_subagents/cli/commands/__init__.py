"""The command groups of `subagent`, one module each; `cli/__init__.py` lists them in order."""
