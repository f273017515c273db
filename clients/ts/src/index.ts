// @leasehold/client: leasehold's ControlService and DoctorService for
// TypeScript, on Connect-ES v2. The messages and service descriptors under
// ./gen are generated from proto/ (npm run generate) and never edited.
import { createClient, type Client, type Interceptor, type Transport } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-node";

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
  /** Extra interceptors, run after the bearer interceptor. */
  interceptors?: Interceptor[];
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
