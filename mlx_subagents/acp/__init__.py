"""`subagent acp`: the agents for editors, as an Agent Client Protocol agent on stdio.

Built on the official SDK (`agent-client-protocol`, imported as `acp`: this package is
`mlx_subagents.acp` and imports the SDK absolutely). `stdio.py` runs the connection, `agent.py`
answers the client's methods, `session.py` is one session (a chat), `updates.py` what the editor
is shown, `client_editor.py` the editor's files, terminal and permissions as the tools see them,
`conversation.py` prompts in and saved conversations out.
"""
