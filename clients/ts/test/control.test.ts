// Calls a running leasehold-api with the generated client. The api is started
// by tools/devstack/withapi (make test-ts), which exports LEASEHOLD_API_URL and
// an admin and a viewer token; without them the test fails rather than skip.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { test } from "node:test";

import { Code, createControlClient, NodeKind, NodeState } from "../src/index.js";
import { connectCode } from "./connect-code.js";

function env(name: string): string {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set: run this test through tools/devstack/withapi (make test-ts)`);
  return v;
}

const baseUrl = env("LEASEHOLD_API_URL");
const admin = createControlClient({ baseUrl, token: env("LEASEHOLD_ADMIN_TOKEN") });
const viewer = createControlClient({ baseUrl, token: env("LEASEHOLD_VIEWER_TOKEN") });

test("a registered node is listed to a viewer", async () => {
  const nodeId = `ts-client-${randomBytes(4).toString("hex")}`;
  const reg = await admin.registerNode({ nodeId, kind: NodeKind.NODE, labels: { from: "ts-client" } });
  assert.equal(reg.node?.id, nodeId);
  assert.ok(reg.credential.length > 0, "RegisterNode returns the node's credential");

  const nodes = [];
  let pageToken = "";
  do {
    const page = await viewer.listNodes({ pageSize: 100, pageToken });
    nodes.push(...page.nodes);
    pageToken = page.nextPageToken;
  } while (pageToken !== "");
  const node = nodes.find((n) => n.id === nodeId);
  assert.ok(node, `ListNodes does not list ${nodeId}`);
  assert.equal(node.state, NodeState.REGISTERED);
  assert.equal(node.kind, NodeKind.NODE);
  assert.equal(node.labels["from"], "ts-client");
});

test("a viewer token may not register a node", async () => {
  const code = await connectCode(viewer.registerNode({ nodeId: "ts-client-denied", kind: NodeKind.NODE }));
  assert.equal(code, Code.PermissionDenied);
});

test("an unknown token and no token are unauthenticated", async () => {
  const wrong = createControlClient({ baseUrl, token: "not-a-token-of-this-api" });
  assert.equal(await connectCode(wrong.listNodes({})), Code.Unauthenticated);
  const none = createControlClient({ baseUrl });
  assert.equal(await connectCode(none.listNodes({})), Code.Unauthenticated);
});

test("bad input is refused with InvalidArgument", async () => {
  const code = await connectCode(admin.registerNode({ nodeId: "", kind: NodeKind.NODE }));
  assert.equal(code, Code.InvalidArgument);
});
