// Package bench holds leasehold's benchmarks that run whole processes: the
// failover gates operators run before a release (multi-gateway fleet
// simulator, lease failover, end-to-end throughput). Each prints a table and
// JSON and exits non-zero when a gate fails.
package bench
