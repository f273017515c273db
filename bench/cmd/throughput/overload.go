package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
)

// The overload scenario (-overload): after the unpaced run that measured
// what one fleet completes at most, offer -overload-factor times that for
// -overload-for, then half of it for -recover-for, and report what
// completed during the overload against the maximum, how many creates the
// api refused, for how many seconds a gateway reported overload, and how
// soon after the overload create-to-done was back under the target p99.
// With -producer api the creates meet the api's admission; with sql they
// bypass it, which shows what the gateways report when nothing refuses.

// recoveredP99 is the create-to-done p99 a second must stay under to count
// as recovered.
const recoveredP99 = 0.5

// overloadWarmup is the start of the overload left out of its completion
// rate: the gateways' hold before they report overload.
const overloadWarmup = 5 * time.Second

type overloadResult struct {
	MaxPS       float64 `json:"max_completed_per_sec"`
	Producer    string  `json:"producer"`
	OfferedPS   float64 `json:"offered_per_sec"`
	AttemptedPS float64 `json:"attempted_per_sec"` // what the creators managed to try of it
	AdmittedPS  float64 `json:"admitted_per_sec"`
	RefusedPS   float64 `json:"refused_per_sec"`
	CompletedPS float64 `json:"completed_per_sec"`
	Share       float64 `json:"completed_share_of_max"`
	// OverloadedSeconds are the seconds of the overload in which a
	// gateway_load row said overloaded (sampled once a second).
	OverloadedSeconds int     `json:"gateway_overloaded_seconds"`
	OverloadP99       float64 `json:"overload_p99_s"`
	// MaxGatewayCores and GatewayCores are the cores the gateways used
	// while the maximum was measured and during the overload (after its
	// warmup): with -gateway-cpus, whether the gateways got their cap.
	MaxGatewayCores float64 `json:"max_gateway_cores"`
	GatewayCores    float64 `json:"gateway_cores"`
	RecoverSeconds  float64 `json:"recovered_after_s"` // -1: not within -recover-for
	RecoveryRate    float64 `json:"recovery_offered_per_sec"`
	// RecoveryP99s is create-to-done p99 per second after the overload,
	// by the second the commands were created in.
	RecoveryP99s []float64 `json:"recovery_p99_per_second_s"`
	Secs         float64   `json:"overload_s"`
	Load         string    `json:"load_average"`
}

// drive offers rate creates per second for d from creators goroutines;
// it returns the creates attempted, those that created a command and
// those the api refused with RESOURCE_EXHAUSTED.
func drive(ctx context.Context, creators int, rate float64, d time.Duration, create func(context.Context) error) (tried, ok, refused int64) {
	cctx, stop := context.WithTimeout(ctx, d)
	defer stop()
	var t, o, r, other atomic.Int64
	var firstErr atomic.Value
	runCreators(cctx, creators, pace(cctx, rate, creators), create, func(err error) {
		t.Add(1)
		switch {
		case err == nil:
			o.Add(1)
		case connect.CodeOf(err) == connect.CodeResourceExhausted:
			r.Add(1)
		default:
			if other.Add(1) == 1 {
				firstErr.Store(err)
			}
		}
	})
	if n := other.Load(); n > 0 {
		logf("  %d create errors other than refusals, first: %v", n, firstErr.Load())
	}
	return t.Load(), o.Load(), r.Load()
}

// overloadRun is the scenario on a fleet whose api takes the creates.
func overloadRun(ctx context.Context, c config, f *fleet.Fleet, prod *fleet.Producer, ids []string, count func() int64, maxPS, maxGatewayCores float64) (*overloadResult, error) {
	r := &overloadResult{MaxPS: maxPS, MaxGatewayCores: maxGatewayCores, Producer: c.producer, RecoverSeconds: -1}
	gatewayCPU := func() (secs float64) {
		for _, g := range f.Gateways {
			if s, ok := harness.ProcessCPU(g.Proc.Cmd.Process.Pid); ok {
				secs += s
			}
		}
		return secs
	}
	create := func(ctx context.Context) error { return prod.Create(ctx, ids[rand.IntN(len(ids))]) }
	creators := max(c.concurrency, 64)
	dbNow := func() (t time.Time, err error) {
		err = f.DB.Pool.QueryRow(ctx, `SELECT compute_now() /*bench*/`).Scan(&t)
		return t, err
	}
	t0, err := dbNow()
	if err != nil {
		return nil, err
	}
	rate := c.overloadFactor * maxPS
	logf("overload: offering %.0f/s (%.1fx the %.0f/s completed unpaced) for %s", rate, c.overloadFactor, maxPS, c.overloadFor)
	var (
		c0, c1   int64
		gw0, gw1 float64
	)
	sampled := make(chan struct{})
	sctx, stopSampling := context.WithCancel(ctx)
	go func() {
		defer close(sampled)
		for i := 0; sctx.Err() == nil; i++ {
			if harness.Sleep(sctx, time.Second) != nil {
				return
			}
			var over bool
			_ = f.DB.Pool.QueryRow(sctx, `SELECT coalesce(bool_or(overloaded), false) /*bench*/ FROM gateway_load`).Scan(&over)
			if over {
				r.OverloadedSeconds++
			}
			if time.Duration(i+1)*time.Second == overloadWarmup {
				c0, gw0 = count(), gatewayCPU()
			}
		}
	}()
	tried, ok, refused := drive(ctx, creators, rate, c.overloadFor, create)
	c1, gw1 = count(), gatewayCPU()
	stopSampling()
	<-sampled
	secs := c.overloadFor.Seconds()
	r.OfferedPS, r.Secs = rate, secs
	r.AttemptedPS, r.AdmittedPS, r.RefusedPS = float64(tried)/secs, float64(ok)/secs, float64(refused)/secs
	r.CompletedPS = float64(c1-c0) / (c.overloadFor - overloadWarmup).Seconds()
	r.Share = r.CompletedPS / maxPS
	r.GatewayCores = (gw1 - gw0) / (c.overloadFor - overloadWarmup).Seconds()
	r.Load = harness.LoadAvg()

	t1, err := dbNow()
	if err != nil {
		return nil, err
	}
	r.RecoveryRate = maxPS / 2
	logf("  %.0f attempted/s, %.0f admitted/s, %.0f refused/s, %.0f completed/s (%.0f%% of the maximum), a gateway overloaded %d s, gateways on %.3f cores (%.3f at the maximum); recovery at %.0f/s for %s",
		r.AttemptedPS, r.AdmittedPS, r.RefusedPS, r.CompletedPS, 100*r.Share, r.OverloadedSeconds, r.GatewayCores, r.MaxGatewayCores, r.RecoveryRate, c.recoverFor)
	drive(ctx, creators, r.RecoveryRate, c.recoverFor, create)
	_ = poll(ctx, c.drain, func() bool {
		var n int64
		_ = f.DB.Pool.QueryRow(ctx, `SELECT count(*) /*bench*/ FROM commands WHERE created_at >= $1 AND state <> 'succeeded'`, t0).Scan(&n)
		return n == 0
	})
	if err := f.DB.Pool.QueryRow(ctx, `
SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at)), 0) /*bench*/
  FROM commands WHERE created_at >= $1 AND created_at < $2 AND state = 'succeeded'`, t0, t1).Scan(&r.OverloadP99); err != nil {
		return nil, fmt.Errorf("overload p99: %w", err)
	}
	rows, err := f.DB.Pool.Query(ctx, `
SELECT floor(extract(epoch FROM created_at - $1))::int AS sec,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM coalesce(finished_at, compute_now()) - created_at)) /*bench*/
  FROM commands WHERE created_at >= $1 GROUP BY 1 ORDER BY 1`, t1)
	if err != nil {
		return nil, fmt.Errorf("recovery p99 per second: %w", err)
	}
	var (
		sec int
		p99 float64
	)
	var p99s []float64
	if _, err := pgx.ForEachRow(rows, []any{&sec, &p99}, func() error { p99s = append(p99s, p99); return nil }); err != nil {
		return nil, fmt.Errorf("recovery p99 per second: %w", err)
	}
	r.RecoverSeconds, r.RecoveryP99s = recoveredAfter(p99s), p99s
	logf("  overload p99 %.3f s; after the overload, every second's p99 < %.1f s from %.0f s on (load %s)", r.OverloadP99, recoveredP99, r.RecoverSeconds, r.Load)
	return r, nil
}

// recoveredAfter is the first second from which every second's p99 is
// under recoveredP99, or -1 when the last one is not.
func recoveredAfter(p99s []float64) float64 {
	at := -1
	for i := len(p99s) - 1; i >= 0 && p99s[i] < recoveredP99; i-- {
		at = i
	}
	return float64(at)
}

func (o *overloadResult) print(w io.Writer) {
	fmt.Fprintf(w, "\noverload (creates via %s): %.0f/s offered, %.0f/s attempted (%.0f admitted, %.0f refused) against a maximum of %.0f completed/s: %.0f completed/s (%.0f%%, target >= 90%%), p99 %.3f s; a gateway reported overload %d s of %.0f; gateways on %.3f cores (%.3f at the maximum)\n",
		o.Producer, o.OfferedPS, o.AttemptedPS, o.AdmittedPS, o.RefusedPS, o.MaxPS, o.CompletedPS, 100*o.Share, o.OverloadP99, o.OverloadedSeconds, o.Secs, o.GatewayCores, o.MaxGatewayCores)
	fmt.Fprintf(w, "recovery at %.0f/s: every second's create-to-done p99 < %.1f s from %.0f s after the overload (target <= 30 s; -1: never) (load %s)\n",
		o.RecoveryRate, recoveredP99, o.RecoverSeconds, o.Load)
	fmt.Fprint(w, "p99 per second after it:")
	for _, p := range o.RecoveryP99s {
		fmt.Fprintf(w, " %.2f", p)
	}
	fmt.Fprintln(w)
}
