//go:build race

package proctest

// raceEnabled is true when the test binary runs under the race detector
// (go test -race): Build then compiles the services with -race as well, so a
// data race inside a real process fails the test that started it.
const raceEnabled = true
