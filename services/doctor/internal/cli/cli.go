// Package cli is leasehold-doctor's command line: `check` (the default)
// prints the findings as a table or JSON and exits 0 ok, 1 warn, 2 critical,
// 3 when something could not be checked (unreachable database, bad usage);
// `serve` runs DoctorService.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/serve"
)

const (
	exitOK = doctor.ExitOK
	// exitUsage and an unreachable database are "could not check": 3,
	// never 2, so a paging rule on 2 fires only for a critical finding,
	// and never 0, so a doctor that cannot run never looks healthy.
	exitUsage       = doctor.ExitUnknown
	exitCannotCheck = doctor.ExitUnknown
)

const usage = `leasehold-doctor: findings about a leasehold deployment, read from its database.

usage:
  leasehold-doctor [check] [flags]   run the checks once and print them (the default command)
  leasehold-doctor serve [flags]     serve DoctorService and /metrics (leasehold_doctor_finding{code})
  leasehold-doctor codes             list the finding codes
  leasehold-doctor version           print the version (also --version)
  leasehold-doctor help              print this help (also -h, --help)

check exits 0 ok, 1 warn, 2 critical, 3 could not check (unreachable database, bad usage).
Flags fall back to LEASEHOLD_* environment variables (--database-url: LEASEHOLD_DATABASE_URL).
Run "leasehold-doctor check -h" or "leasehold-doctor serve -h" for the flags; docs/doctor.md explains every finding.
`

// Main runs the command line and returns the exit status.
func Main(ctx context.Context, args []string, stdout, stderr *os.File) int {
	cmd := "check"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	} else if len(args) == 1 {
		// Top-level flags of their own: help and version, not check's.
		switch strings.TrimLeft(args[0], "-") {
		case "h", "help":
			cmd = "help"
		case lifecycle.VersionFlag:
			cmd = "version"
		}
	}
	switch cmd {
	case "version":
		lifecycle.PrintVersion(stdout, "doctor")
		return exitOK
	case "check":
		return check(ctx, args, stdout, stderr)
	case "serve":
		return serve.Run(ctx, args, stderr)
	case "codes":
		for _, c := range doctor.Codes() {
			fmt.Fprintln(stdout, c)
		}
		return exitOK
	case "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	}
	fmt.Fprintf(stderr, "leasehold-doctor: unknown command %q\n\n%s", cmd, usage)
	return exitUsage
}

type checkFlags struct {
	databaseURL string
	asJSON      bool
	codes       string
	color       string
	verbose     bool
	timeout     time.Duration
	doctor      doctor.Config
}

func (c *checkFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL URL; a read-only role is enough (env LEASEHOLD_DATABASE_URL)")
	fs.BoolVar(&c.asJSON, "json", false, "print JSON for machines instead of the table")
	fs.StringVar(&c.codes, "codes", "", "comma-separated finding codes to run (default: all; see `leasehold-doctor codes`)")
	fs.StringVar(&c.color, "color", "auto", "colour the table: auto (only on a terminal, not with NO_COLOR), always, never")
	fs.BoolVar(&c.verbose, "verbose", false, "print evidence under ok findings too")
	fs.DurationVar(&c.timeout, "timeout", 2*time.Minute, "bound on the whole run")
	c.doctor.RegisterFlags("", fs)
}

func (c *checkFlags) validate() error {
	var errs []error
	if c.databaseURL == "" {
		errs = append(errs, errors.New("--database-url (LEASEHOLD_DATABASE_URL) is required"))
	}
	switch c.color {
	case "auto", "always", "never":
	default:
		errs = append(errs, fmt.Errorf("--color %q must be auto, always or never", c.color))
	}
	if c.timeout <= 0 {
		errs = append(errs, fmt.Errorf("--timeout %s must be positive", c.timeout))
	}
	return errors.Join(append(errs, c.doctor.Validate())...)
}

func check(ctx context.Context, args []string, stdout, stderr *os.File) int {
	var c checkFlags
	fs := flag.NewFlagSet("leasehold-doctor check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	c.register(fs)
	showVersion := lifecycle.RegisterVersionFlag(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	if *showVersion {
		lifecycle.PrintVersion(stdout, "doctor")
		return exitOK
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "leasehold-doctor check: unexpected arguments %q\n", fs.Args())
		return exitUsage
	}
	if err := lifecycle.ApplyEnv(fs); err != nil {
		fmt.Fprintf(stderr, "leasehold-doctor: %v\n", err)
		return exitUsage
	}
	if err := c.validate(); err != nil {
		fmt.Fprintf(stderr, "leasehold-doctor: invalid configuration:\n%v\n", err)
		return exitUsage
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()

	rep, err := run(ctx, c)
	if err != nil {
		var unknown *doctor.UnknownCodeError
		if errors.As(err, &unknown) {
			fmt.Fprintf(stderr, "leasehold-doctor: %v\n", err)
			return exitUsage
		}
		if c.asJSON {
			writeJSONError(stdout, err)
		}
		fmt.Fprintf(stderr, "leasehold-doctor: %v\n", err)
		return exitCannotCheck
	}
	if c.asJSON {
		if err := writeJSON(stdout, rep); err != nil {
			fmt.Fprintf(stderr, "leasehold-doctor: write JSON: %v\n", err)
			return exitCannotCheck
		}
	} else {
		writeTable(stdout, rep, useColour(c.color, stdout), c.verbose)
	}
	return rep.ExitCode()
}

func run(ctx context.Context, c checkFlags) (doctor.Report, error) {
	// Pooler mode keeps no statement cache, so the doctor works through
	// PgBouncer in transaction mode as well as directly. Read-only: doctor
	// may run on a standby or a multi-host URL; db.url judges the URL.
	db, err := pgdb.Connect(ctx, pgdb.Config{URL: c.databaseURL, AppName: "leasehold-doctor", MaxConns: 4, Pooler: true,
		ReadOnly: true, Setting: "--database-url"})
	if err != nil {
		return doctor.Report{}, fmt.Errorf("cannot reach the database: %w", err)
	}
	defer db.Close()
	d, err := doctor.New(c.doctor, db)
	if err != nil {
		return doctor.Report{}, err
	}
	var codes []string
	if c.codes != "" {
		codes = strings.Split(c.codes, ",")
	}
	return d.Run(ctx, codes)
}
