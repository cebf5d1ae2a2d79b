// A 2026-07-28 client nobody here wrote: the MCP TypeScript SDK's Client (version negotiation `auto`) with
// the Tasks extension's requester (`@modelcontextprotocol/ext-tasks`), which calls a tool, takes the task
// handle, polls tasks/get and settles the result. Usage: node tasks_client.mjs NODE_MODULES URL TOKEN TOOL ARGS_JSON
// The one part written here is `rawDispatch`, the host's request path that ext-tasks asks for on 2026-07-28
// (its SDK adapter cannot send task requests through the Client): a JSON-RPC request POSTed with the headers.
// Prints one JSON line: the era, the methods sent, the settled result.
const [modules, url, token, tool, args] = process.argv.slice(2);
const { Client, StreamableHTTPClientTransport } = await import(`${modules}/@modelcontextprotocol/client/dist/index.mjs`);
const { createTaskSessionFromClient, resultFromTaskOutcome } = await import(
  `${modules}/@modelcontextprotocol/ext-tasks/dist/client/index.js`
);

const auth = { Authorization: `Bearer ${token}` };
const info = { name: "ts-tasks", version: "1" };
const client = new Client(info, { capabilities: {}, versionNegotiation: { mode: "auto" } });
await client.connect(new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers: auth } }));
const version = "2026-07-28";
const sent = [];
let nextId = 1;

async function rawDispatch(request, options) {
  const message = { jsonrpc: "2.0", id: nextId++, ...request };
  sent.push(message.method);
  const headers = {
    ...auth,
    "Content-Type": "application/json",
    Accept: "application/json, text/event-stream",
    "MCP-Protocol-Version": version,
    "Mcp-Method": message.method,
  };
  const name = message.params?.name ?? message.params?.taskId;
  if (name !== undefined) headers["Mcp-Name"] = String(name);
  const response = await fetch(url, { method: "POST", headers, body: JSON.stringify(message), signal: options?.signal });
  let text = await response.text();
  if ((response.headers.get("content-type") || "").includes("text/event-stream")) {
    text = text.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5)).at(-1);
  }
  const body = JSON.parse(text);
  return "error" in body ? { kind: "error", error: body } : { kind: "result", result: body.result };
}

const session = createTaskSessionFromClient(client, {
  endpointId: "subagent",
  rawDispatch,
  v2RequestFraming: {
    protocolVersion: version,
    clientInfo: info,
    clientCapabilities: { extensions: { "io.modelcontextprotocol/tasks": {} } },
  },
});
const execution = await session.callTool(tool, JSON.parse(args));
const { outcome } = await execution.settle();
const result = resultFromTaskOutcome(outcome);
console.log(JSON.stringify({ era: client.getProtocolEra(), sent, result }));
await session.close();
await client.close();
