// Package bench holds leasehold's benchmarks that run whole processes: the
// failover gates operators run before a release. Each prints a table and
// JSON and exits non-zero when a gate fails; docs/high-availability.md
// quotes their results.
//
//   - multi-gateway: fleet simulator. Three gateways behind HAProxy, the
//     worker, scheduler and api, real PostgreSQL and N simulated daemons
//     with commands flowing; -scenario kill|zombie|drain, -nodes N.
//   - cmd/leasefailover: crash, pause and SIGTERM takeover of a worker's
//     leases, River's leader election side by side, coordination load of
//     1/4/16/64 members.
//   - cmd/throughput: commands/s end to end through 1 and 3 gateways, and
//     River's jobs/s on the same server; -overload offers twice what one
//     gateway completes and measures admission and recovery.
//   - cmd/riverclient: the River client process the two above start.
//   - cmd/nodeagent: the real node agent (leasehold-node) against its
//     targets: idle RSS and CPU, exec /bin/true create-to-done and its
//     phases, 100 MiB of live output to a live reader (docs/node.md,
//     "Figures"); it reports, and with -gate fails on a missed target.
//   - cmd/scale: what connected nodes and their commands cost one
//     PostgreSQL primary at 1,000, 5,000 and 10,000 nodes, a line fitted
//     per 1,000 nodes and the nodes a primary holds at half its cores
//     (docs/scaling.md).
//
// `make bench-failover`, `make bench-throughput`, `make bench-scale`,
// `make bench-node` and `make demo` run them.
package bench
