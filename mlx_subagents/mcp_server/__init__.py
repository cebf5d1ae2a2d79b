"""The MCP front end: the agents as tools of an MCP server on stdio (`subagent mcp`)."""
