package harness

import (
	"fmt"
	"os"
	"time"
)

// Logf prints a bench's progress line to stderr, prefixed with the wall
// clock (HH:MM:SS), so a run's log lines up with load averages and the
// server's own log.
func Logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}
