// Package e2e holds end-to-end tests that run several leasehold services as
// real processes against a real PostgreSQL: gateways, workers, schedulers
// and the api together, with nodes connected through pkg/daemon.
package e2e
