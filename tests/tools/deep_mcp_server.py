"""A hostile MCP server for the tests: plain JSON-RPC on stdio, nesting what it sends `DEPTH` (its
second argument) levels deep. `schema` (the default): its one tool's input schema; `structured`: the
tool's result's `structuredContent`; `elicit`: during the call, an elicitation whose requested schema
nests. The JSON is written by hand: Python's own encoder stops at its recursion limit."""

import json
import sys

depth = int(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "schema"


def nested(inner: str, times: int) -> str:
    """`inner` wrapped `times` times as a schema's property (`{"type": "object", "properties": {"x": ...}}`)."""
    return '{"type": "object", "properties": {"x": ' * times + inner + "}}" * times


flat = {"type": "object", "properties": {}}
schema = nested('{"type": "string"}', depth) if mode == "schema" else json.dumps(flat)


def send(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message or "method" not in message:
        continue
    reply = "{}"
    if message["method"] == "initialize":
        info = {"name": "deep", "version": "1"}
        caps = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}}}
        reply = json.dumps({**caps, "serverInfo": info})
    elif message["method"] == "tools/list":
        reply = '{"tools": [{"name": "deep", "description": "nested", "inputSchema": ' + schema + "}]}"
    elif message["method"] == "tools/call" and mode == "structured":
        deep = '{"x": ' * depth + "1" + "}" * depth
        reply = '{"content": [], "structuredContent": ' + deep + "}"
    elif message["method"] == "tools/call" and mode == "elicit":
        params = '{"message": "tell me", "requestedSchema": ' + nested('{"type": "string"}', depth) + "}"
        send('{"jsonrpc": "2.0", "id": "ask", "method": "elicitation/create", "params": ' + params + "}")
        sys.stdin.readline()  # its answer, whatever it is
        reply = '{"content": [{"type": "text", "text": "answered"}]}'
    send('{"jsonrpc": "2.0", "id": ' + json.dumps(message["id"]) + ', "result": ' + reply + "}")
