// The Connect code a call failed with, for the tests: the call must fail.
import assert from "node:assert/strict";

import { type Code, ConnectError } from "../src/index.js";

/** connectCode awaits call and returns the Code it failed with; a call that succeeds fails the test. */
export async function connectCode(call: Promise<unknown>): Promise<Code> {
  try {
    await call;
  } catch (err) {
    return ConnectError.from(err).code;
  }
  assert.fail("the call succeeded");
}
