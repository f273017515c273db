// Package cli is the leasehold operator CLI: contexts in a configuration
// file, and commands over leasehold-api's ControlService (nodes, commands,
// logs, run and runs, tunnels, join tokens, the coordination views).
package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/pkg/buildinfo"
)

// app holds the global flags and the process's streams.
type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string

	cfgPath     string
	contextName string
	apiURL      string
	tokenFile   string
	output      string
	verbose     bool
	retryFor    time.Duration
}

// Main runs the CLI with args (without the program name) and returns the
// exit status: 0 success, 1 a failed operation, 2 bad usage, 130
// interrupted.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr, getenv: os.Getenv}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := classifyCobra(root.ExecuteContext(ctx))
	return report(stderr, err, ctx.Err() != nil)
}

func (a *app) debugf(format string, args ...any) {
	if a.verbose {
		_, _ = fmt.Fprintf(a.stderr, "leasehold: "+format+"\n", args...)
	}
}

func (a *app) loadConfig() (*Config, error) {
	if a.cfgPath == "" {
		p, err := ConfigPath(a.getenv)
		if err != nil {
			return nil, err
		}
		a.cfgPath = p
	}
	return LoadConfig(a.cfgPath)
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "leasehold",
		Short: "Operate a leasehold fleet through leasehold-api",
		Long: `leasehold talks to leasehold-api's ControlService with a bearer token.

Contexts (leasehold context set|use|ls|delete) name an api and where its token
comes from; they live in $LEASEHOLD_CONFIG, else
$XDG_CONFIG_HOME/leasehold/config.yaml, else ~/.config/leasehold/config.yaml.
--context or LEASEHOLD_CONTEXT picks one, else the current context;
--api and --token-file override its fields. Without a context, --api and
the token in LEASEHOLD_TOKEN (or --token-file) are used.

Exit status: 0 success, 1 a failed operation, 2 bad usage, 130 interrupted.`,
		Version:       buildinfo.Version(),
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if a.retryFor < 0 {
				return usagef("--retry-for %s must not be negative (0 turns repeats off)", a.retryFor)
			}
			return checkFormat(a.output)
		},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err: err} })
	pf := root.PersistentFlags()
	pf.StringVar(&a.contextName, "context", "", "the context to use (default: $LEASEHOLD_CONTEXT, else the current context)")
	pf.StringVar(&a.apiURL, "api", "", "leasehold-api's URL, over the context's (http:// for h2c, https:// for TLS)")
	pf.StringVar(&a.tokenFile, "token-file", "", "a file holding the bearer token, over the context's")
	pf.StringVarP(&a.output, "output", "o", formatTable, "output format: table, wide, json or yaml")
	pf.DurationVar(&a.retryFor, "retry-for", 30*time.Second, "repeat a call the api refused as busy (a rate limit, a node's full queue, an overloaded gateway: nothing was done) for up to this long, after the wait it asks for; 0 turns repeats off")
	pf.BoolVarP(&a.verbose, "verbose", "v", false, "log the context, the token's source (never the token) and each call to stderr")
	_ = root.RegisterFlagCompletionFunc("context", a.completeContexts)
	_ = root.RegisterFlagCompletionFunc("output", cobra.FixedCompletions(formats, cobra.ShellCompDirectiveNoFileComp))

	root.AddCommand(a.contextCommand(), a.nodesCommand(),
		a.cordonCommand(), a.uncordonCommand(), a.drainCommand(), a.decommissionCommand(),
		a.leasesCommand(), a.workersCommand(), a.gatewaysCommand(), a.auditCommand(),
		a.tokensCommand(), a.joinTokensCommand(), a.commandsCommand(), a.logsCommand(), a.cancelCommand(),
		a.runCommand(), a.runsCommand(), a.portForwardCommand(), a.shellCommand())
	return root
}

// args checks a command's positional arguments, as a usage error.
func exactArgs(n int, names string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return usagef("want %s, got %d argument(s)", names, len(args))
		}
		return nil
	}
}

// interrupted is the error of a command that stopped on Ctrl-C.
var interrupted = &exitError{code: exitInterrupted}
