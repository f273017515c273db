package harness

import (
	"os"
	"strings"
)

// LoadAvg is the machine's 1, 5 and 15 minute load averages
// (/proc/loadavg), "?" when unreadable.
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
