package doctor_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
)

func TestRegionsMapping(t *testing.T) {
	t.Parallel()
	var r doctor.Regions
	require.Equal(t, "default", r.Of("gw-a"))
	require.NoError(t, r.Set("gw-a=eu, gw-us-*=us,gw-us-east-*=us-east"))
	require.Equal(t, "eu", r.Of("gw-a"))
	require.Equal(t, "us", r.Of("gw-us-west-1"))
	require.Equal(t, "us-east", r.Of("gw-us-east-1"), "the longest prefix wins")
	require.Equal(t, "default", r.Of("gw-b"))
	require.ErrorContains(t, r.Set("gw-a"), "want gateway=region")
}

func TestConfigValidateNamesTheFlag(t *testing.T) {
	t.Parallel()
	c := doctor.DefaultConfig()
	require.NoError(t, c.Validate())
	c.LiveWindow = c.LeaseTTL
	c.MaxStreams = 0
	err := c.Validate()
	require.ErrorContains(t, err, "--live-window 15s must be longer than --lease-ttl 15s")
	require.ErrorContains(t, err, "--max-streams 0")
}

func TestExitCodeAndWorst(t *testing.T) {
	t.Parallel()
	rep := func(sev ...doctor.Severity) doctor.Report {
		var r doctor.Report
		for _, s := range sev {
			r.Findings = append(r.Findings, doctor.Finding{Severity: s})
		}
		return r
	}
	require.Equal(t, 0, rep(doctor.SeverityOK, doctor.SeverityOK).ExitCode())
	require.Equal(t, 3, rep(doctor.SeverityOK, doctor.SeverityUnknown).ExitCode(), "unchecked never passes: could not check")
	require.Equal(t, 1, rep(doctor.SeverityUnknown, doctor.SeverityWarn).ExitCode())
	require.Equal(t, doctor.SeverityWarn, rep(doctor.SeverityUnknown, doctor.SeverityWarn).Worst())
	require.Equal(t, 2, rep(doctor.SeverityWarn, doctor.SeverityCritical, doctor.SeverityUnknown).ExitCode())
	require.Equal(t, -1.0, doctor.SeverityUnknown.Gauge())
	require.Equal(t, 2.0, doctor.SeverityCritical.Gauge())
}
