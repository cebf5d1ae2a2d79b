"""The machine's server (`subagent serve`): one process per state folder holding the hosts, serving MCP
over HTTP and its unix socket, attached commands and relayed `subagent mcp` sessions."""
