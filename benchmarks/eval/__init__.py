"""The agent eval's parts (`benchmarks/agent_eval.py`): the pinned source, the task file, scoring."""
