"""The MCP front end: the agents as tools of one MCP server (`subagent mcp` on stdio; `serve` hosts it too)."""
