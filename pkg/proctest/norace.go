//go:build !race

package proctest

// raceEnabled is false in an ordinary test binary: services are built
// without the race detector.
const raceEnabled = false
