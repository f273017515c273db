package apiclient

import (
	"context"
	"time"
)

// SetSleep replaces r's wait between repeats.
func SetSleep(r *Retry, sleep func(ctx context.Context, d time.Duration) error) { r.sleep = sleep }
