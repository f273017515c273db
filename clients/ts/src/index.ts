// @leasehold/client: leasehold's ControlService and DoctorService for
// TypeScript, on Connect-ES v2. The messages and service descriptors under
// ./gen are generated from proto/ (npm run generate) and never edited.
import { Code, ConnectError, createClient, type Client, type Interceptor, type Transport } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-node";
import { setTimeout as delay } from "node:timers/promises";

import { ControlService } from "./gen/leasehold/control/v1/control_pb.js";
import { DoctorService } from "./gen/leasehold/doctor/v1/doctor_pb.js";

export * from "./gen/leasehold/control/v1/control_pb.js";
export { DoctorService } from "./gen/leasehold/doctor/v1/doctor_pb.js";
export type * from "./gen/leasehold/doctor/v1/doctor_pb.js";
export { NodeKind } from "./gen/leasehold/node/v1/node_pb.js";
export { Code, ConnectError } from "@connectrpc/connect";

/** Options of {@link createControlClient} and {@link createDoctorClient}. */
export interface ClientOptions {
  /** Base URL of the server, e.g. http://127.0.0.1:8080 (no trailing path). */
  baseUrl: string;
  /**
   * Bearer token sent as `Authorization: Bearer <token>` on every call
   * (ControlService: a viewer, operator or admin token; DoctorService: its
   * --api-token, if set). Omit it to send no Authorization header.
   */
  token?: string;
  /** "1.1" (default) or "2" (h2c for http://, HTTP/2 over TLS for https://). */
  httpVersion?: "1.1" | "2";
  /**
   * Repeat a unary call the api refused as busy for at most this many
   * milliseconds of waits (see {@link retry}); default 0: every refusal is
   * returned at once. The CLI waits up to 30 s.
   */
  retryForMs?: number;
  /** Told of each wait of {@link ClientOptions.retryForMs} before it starts. */
  onRetryWait?: RetryOptions["onWait"];
  /** Extra interceptors, run after the bearer and retry interceptors. */
  interceptors?: Interceptor[];
}

/** Options of {@link retry}. */
export interface RetryOptions {
  /** Bounds the waits of one call, in milliseconds, counted from its first refusal; 0 or less turns repeats off. */
  forMs: number;
  /** Told of each wait before it starts: the method's proto name (ListNodes), the wait in milliseconds, the refusal. */
  onWait?: (method: string, waitMs: number, refusal: ConnectError) => void;
}

/**
 * retry returns an interceptor that repeats a unary call leasehold-api
 * refused as busy: RESOURCE_EXHAUSTED with a Retry-After header, which the
 * api sends only on refusals that pass within seconds (a caller over its
 * rate limit, a node whose gateway reports overload) and only before it has
 * written anything, so a repeat cannot do anything twice. A
 * RESOURCE_EXHAUSTED without Retry-After (a message over the size limit, a
 * node whose queue is full) would be refused again and is thrown at once, as
 * is every other error. Each wait is the refusal's Retry-After plus up to a
 * fifth at random, so callers refused together do not come back together;
 * once the next wait would take the call past forMs, the last refusal is
 * thrown. Streaming calls are never repeated: a stream may have been half
 * used when it was refused. A call's abort signal ends a wait with the
 * abort's error. The same rules as the Go client's apiclient.Retry.
 */
export function retry(opts: RetryOptions): Interceptor {
  return (next) => async (req) => {
    if (req.stream || opts.forMs <= 0) return next(req);
    let waited = 0;
    for (;;) {
      try {
        return await next(req);
      } catch (err) {
        const refusal = ConnectError.from(err);
        const after = refusal.code === Code.ResourceExhausted ? retryAfterMs(refusal) : 0;
        if (after === 0) throw err;
        const wait = after + Math.floor((Math.random() * after) / 5);
        if (waited + wait > opts.forMs) throw err;
        opts.onWait?.(req.method.name, wait, refusal);
        // The call's abort ends the wait as it ends the call: Canceled.
        await delay(wait, undefined, { signal: req.signal }).catch(() => {
          throw ConnectError.from(req.signal.reason);
        });
        waited += wait;
      }
    }
  };
}

/** retryAfterMs is a refusal's Retry-After (whole seconds; the api sends no dates) in milliseconds, at most a minute; 0 when it has none. */
function retryAfterMs(err: ConnectError): number {
  const v = err.metadata.get("Retry-After");
  if (v === null || !/^[0-9]+$/.test(v.trim())) return 0;
  return Math.min(Number(v.trim()), 60) * 1000;
}

/** bearer returns an interceptor that sets the Authorization header of every call. */
export function bearer(token: string): Interceptor {
  return (next) => async (req) => {
    req.header.set("Authorization", `Bearer ${token}`);
    return next(req);
  };
}

/** createTransport returns a Connect-protocol transport for Node.js with the bearer token applied. */
export function createTransport(opts: ClientOptions): Transport {
  const interceptors: Interceptor[] = [];
  if (opts.token !== undefined) interceptors.push(bearer(opts.token));
  if ((opts.retryForMs ?? 0) > 0) interceptors.push(retry({ forMs: opts.retryForMs ?? 0, onWait: opts.onRetryWait }));
  interceptors.push(...(opts.interceptors ?? []));
  return createConnectTransport({
    baseUrl: opts.baseUrl,
    httpVersion: opts.httpVersion ?? "1.1",
    interceptors,
  });
}

/**
 * createControlClient returns a client of leasehold.control.v1.ControlService
 * (served by leasehold-api). Errors are ConnectError with a Code:
 * Unauthenticated for a missing or unknown token, PermissionDenied when the
 * token's role is too low, InvalidArgument naming the bad field.
 */
export function createControlClient(opts: ClientOptions): Client<typeof ControlService> {
  return createClient(ControlService, createTransport(opts));
}

/** createDoctorClient returns a client of leasehold.doctor.v1.DoctorService (leasehold-doctor serve). */
export function createDoctorClient(opts: ClientOptions): Client<typeof DoctorService> {
  return createClient(DoctorService, createTransport(opts));
}
