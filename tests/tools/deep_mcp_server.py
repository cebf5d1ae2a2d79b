"""A hostile MCP server for the tests: plain JSON-RPC on stdio, whose one tool's input schema nests a
property `DEPTH` (its argument) times."""

import json
import sys

schema: dict = {"type": "string"}
for _ in range(int(sys.argv[1])):
    schema = {"type": "object", "properties": {"x": schema}}
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    if message["method"] == "initialize":
        info = {"name": "deep", "version": "1"}
        result = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": info,
        }
    elif message["method"] == "tools/list":
        result = {"tools": [{"name": "deep", "description": "nested", "inputSchema": schema}]}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
