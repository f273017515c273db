// The retry interceptor against a Connect server on loopback (connect-node's
// adapter on node:http), whose ControlService refuses as the api does: the
// first calls RESOURCE_EXHAUSTED with or without Retry-After, then an answer.
// Real HTTP and the real Connect protocol: what is tested is what the
// client reads from the wire.
import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";

import type { ConnectRouter } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";

import { Code, ConnectError, ControlService, createControlClient } from "../src/index.js";
import { connectCode } from "./connect-code.js";

/** What the server refuses next, by method name; each refusal is used once. */
const refusals: Record<string, { code: Code; retryAfter?: string }[]> = {};
/** Calls the server saw, by method name. */
const calls: Record<string, number> = {};

function refuseOrAnswer(method: string): void {
  calls[method] = (calls[method] ?? 0) + 1;
  const r = refusals[method]?.shift();
  if (r === undefined) return;
  const header = new Headers();
  if (r.retryAfter !== undefined) header.set("Retry-After", r.retryAfter);
  throw new ConnectError("busy (test)", r.code, header);
}

let server: Server;
let baseUrl: string;

before(async () => {
  const routes = (router: ConnectRouter) =>
    router.service(ControlService, {
      listNodes: async () => {
        refuseOrAnswer("ListNodes");
        return {};
      },
      streamCommandOutput: async function* () {
        refuseOrAnswer("StreamCommandOutput");
        yield {};
      },
    });
  server = createServer(connectNodeAdapter({ routes }));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  baseUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

after(() => {
  server.closeAllConnections();
  server.close();
});

function reset(method: string, ...r: { code: Code; retryAfter?: string }[]): void {
  refusals[method] = r;
  calls[method] = 0;
}

test("a call refused with Retry-After is repeated after the wait it asks, plus at most a fifth", async () => {
  reset("ListNodes", { code: Code.ResourceExhausted, retryAfter: "1" }, { code: Code.ResourceExhausted, retryAfter: "1" });
  const waits: number[] = [];
  const client = createControlClient({
    baseUrl,
    retryForMs: 10_000,
    onRetryWait: (method, waitMs, refusal) => {
      assert.equal(method, "ListNodes");
      assert.equal(refusal.code, Code.ResourceExhausted);
      waits.push(waitMs);
    },
  });
  const start = performance.now();
  await client.listNodes({});
  const took = performance.now() - start;
  assert.equal(calls["ListNodes"], 3, "two refusals, then the answer");
  assert.equal(waits.length, 2);
  for (const w of waits) assert.ok(w >= 1000 && w <= 1200, `wait ${w} ms is not Retry-After (1 s) plus at most a fifth`);
  assert.ok(took >= 2000, `the call returned after ${took} ms, before its two waits`);
});

test("a refusal is thrown at once when repeating it is not allowed", async (t) => {
  const client = createControlClient({ baseUrl, retryForMs: 10_000 });
  await t.test("RESOURCE_EXHAUSTED without Retry-After (it would be refused again)", async () => {
    reset("ListNodes", { code: Code.ResourceExhausted });
    assert.equal(await connectCode(client.listNodes({})), Code.ResourceExhausted);
    assert.equal(calls["ListNodes"], 1);
  });
  await t.test("another code, even with Retry-After", async () => {
    reset("ListNodes", { code: Code.Unavailable, retryAfter: "1" });
    assert.equal(await connectCode(client.listNodes({})), Code.Unavailable);
    assert.equal(calls["ListNodes"], 1);
  });
  await t.test("a wait that does not fit in retryForMs", async () => {
    reset("ListNodes", { code: Code.ResourceExhausted, retryAfter: "5" });
    let waits = 0;
    const short = createControlClient({ baseUrl, retryForMs: 2_000, onRetryWait: () => waits++ });
    assert.equal(await connectCode(short.listNodes({})), Code.ResourceExhausted);
    assert.equal(calls["ListNodes"], 1);
    assert.equal(waits, 0, "it waited although the wait could not fit");
  });
  await t.test("retry off (the default)", async () => {
    reset("ListNodes", { code: Code.ResourceExhausted, retryAfter: "1" });
    assert.equal(await connectCode(createControlClient({ baseUrl }).listNodes({})), Code.ResourceExhausted);
    assert.equal(calls["ListNodes"], 1);
  });
  await t.test("a stream (it may have been half used)", async () => {
    reset("StreamCommandOutput", { code: Code.ResourceExhausted, retryAfter: "1" });
    const drain = async () => {
      for await (const _ of client.streamCommandOutput({ commandId: "c" })) {
        // nothing to read: the first message is the refusal
      }
    };
    assert.equal(await connectCode(drain()), Code.ResourceExhausted);
    assert.equal(calls["StreamCommandOutput"], 1);
  });
});

test("aborting a call ends its wait", async () => {
  reset("ListNodes", { code: Code.ResourceExhausted, retryAfter: "30" });
  const ctl = new AbortController();
  let waitStarted!: () => void;
  const started = new Promise<void>((resolve) => (waitStarted = resolve));
  const client = createControlClient({ baseUrl, retryForMs: 60_000, onRetryWait: () => waitStarted() });
  const result = connectCode(client.listNodes({}, { signal: ctl.signal }));
  await started;
  const start = performance.now();
  ctl.abort();
  assert.equal(await result, Code.Canceled);
  assert.ok(performance.now() - start < 20_000, "the abort did not end the 30 s wait");
  assert.equal(calls["ListNodes"], 1);
});
