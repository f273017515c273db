package cli

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"gopkg.in/yaml.v3"
)

func (a *app) contextCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "context",
		Short: "Manage contexts: an api and where its token comes from",
		Long: `A context names a leasehold-api URL and where its bearer token comes from: a
file (--token-file) or an environment variable (--token-env); the token itself
is never stored in the configuration file. The file is written with mode 0600,
atomically; a file that group or others can access, or with unknown keys, is
refused.`,
	}
	cmd.AddCommand(a.contextLsCommand(), a.contextUseCommand(), a.contextSetCommand(), a.contextDeleteCommand())
	return cmd
}

func (a *app) contextLsCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the contexts; * marks the current one",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := a.loadConfig()
			if err != nil {
				return err
			}
			switch a.output {
			case formatJSON:
				b, err := json.MarshalIndent(contextsDoc(cfg), "", "  ")
				if err != nil {
					return fmt.Errorf("encode contexts: %w", err)
				}
				_, err = fmt.Fprintf(a.stdout, "%s\n", b)
				return err
			case formatYAML:
				b, err := yaml.Marshal(cfg)
				if err != nil {
					return fmt.Errorf("encode contexts: %w", err)
				}
				_, err = a.stdout.Write(b)
				return err
			}
			t := newTable(a.stdout, "CURRENT", "NAME", "API", "TOKEN FROM", "CA FILE")
			for _, n := range cfg.Names() {
				c := cfg.Contexts[n]
				cur := ""
				if n == cfg.CurrentContext {
					cur = "*"
				}
				src := "env LEASEHOLD_TOKEN"
				if c.TokenFile != "" {
					src = "file " + c.TokenFile
				} else if c.TokenEnv != "" {
					src = "env " + c.TokenEnv
				}
				t.row(cur, n, c.API, src, c.CAFile)
			}
			return t.flush()
		},
	}
}

// contextsDoc is the configuration as a JSON document with the file's key
// names.
func contextsDoc(cfg *Config) map[string]any {
	ctxs := map[string]any{}
	for n, c := range cfg.Contexts {
		m := map[string]string{"api": c.API}
		if c.TokenFile != "" {
			m["token-file"] = c.TokenFile
		}
		if c.TokenEnv != "" {
			m["token-env"] = c.TokenEnv
		}
		if c.CAFile != "" {
			m["ca-file"] = c.CAFile
		}
		ctxs[n] = m
	}
	return map[string]any{"current-context": cfg.CurrentContext, "contexts": ctxs}
}

func (a *app) contextUseCommand() *cobra.Command {
	return &cobra.Command{
		Use:               "use NAME",
		Short:             "Make NAME the current context",
		Args:              exactArgs(1, "NAME"),
		ValidArgsFunction: a.completeContexts,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := a.loadConfig()
			if err != nil {
				return err
			}
			if cfg.Contexts[args[0]] == nil {
				return usagef("no context %q in %s (contexts: %s)", args[0], a.cfgPath, strings.Join(cfg.Names(), ", "))
			}
			cfg.CurrentContext = args[0]
			if err := cfg.Save(a.cfgPath); err != nil {
				return err
			}
			_, err = fmt.Fprintf(a.stdout, "current context: %s\n", args[0])
			return err
		},
	}
}

func (a *app) contextSetCommand() *cobra.Command {
	var api, tokenFile, tokenEnv, caFile string
	var use bool
	cmd := &cobra.Command{
		Use:   "set NAME --api URL [--token-file F | --token-env VAR] [--ca-file F] [--use]",
		Short: "Create or update the context NAME",
		Long: `Create the context NAME, or update the fields given of an existing one
(--token-file replaces a token-env and the other way round). Other contexts are
left alone. NAME becomes the current context when there is none, or with --use.

A dev stack keeps its context current with:

  leasehold context set dev --api http://127.0.0.1:8080 --token-env LEASEHOLD_DEV_TOKEN`,
		Args:              exactArgs(1, "NAME"),
		ValidArgsFunction: a.completeContexts,
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			if !contextNameRE.MatchString(name) {
				return usagef("context name %q: must match %s", name, contextNameRE)
			}
			if tokenFile != "" && tokenEnv != "" {
				return usagef("--token-file and --token-env are exclusive")
			}
			if tokenEnv != "" && !envNameRE.MatchString(tokenEnv) {
				return usagef("--token-env %q: not an environment variable name", tokenEnv)
			}
			cfg, err := a.loadConfig()
			if err != nil {
				return err
			}
			c := cfg.Contexts[name]
			created := c == nil
			if created {
				if api == "" {
					return usagef("--api is required for a new context")
				}
				c = &Context{}
			} else {
				copied := *c
				c = &copied
			}
			if api != "" {
				if err := validateAPI(api); err != nil {
					return usagef("--api: %v", err)
				}
				c.API = api
			}
			if tokenFile != "" {
				c.TokenFile, c.TokenEnv = absPath(tokenFile), ""
			}
			if tokenEnv != "" {
				c.TokenEnv, c.TokenFile = tokenEnv, ""
			}
			if caFile != "" {
				c.CAFile = absPath(caFile)
			}
			if err := c.validate(name); err != nil {
				return usagef("%v", err)
			}
			cfg.Contexts[name] = c
			if use || cfg.CurrentContext == "" {
				cfg.CurrentContext = name
			}
			if err := cfg.Save(a.cfgPath); err != nil {
				return err
			}
			verb := "updated"
			if created {
				verb = "created"
			}
			suffix := ""
			if cfg.CurrentContext == name {
				suffix = " (current)"
			}
			_, err = fmt.Fprintf(a.stdout, "context %s %s in %s%s\n", name, verb, a.cfgPath, suffix)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&api, "api", "", "leasehold-api's URL (http://host:port for h2c, https:// for TLS)")
	f.StringVar(&tokenFile, "token-file", "", "a file holding the bearer token")
	f.StringVar(&tokenEnv, "token-env", "", "an environment variable holding the bearer token")
	f.StringVar(&caFile, "ca-file", "", "PEM CA certificates to trust for an https api")
	f.BoolVar(&use, "use", false, "make it the current context even when another one is")
	// The global --api and --token-file are overrides for calls; set's own
	// flags shadow them here.
	return cmd
}

func (a *app) contextDeleteCommand() *cobra.Command {
	return &cobra.Command{
		Use:               "delete NAME",
		Short:             "Delete the context NAME (the current context becomes none when it was)",
		Args:              exactArgs(1, "NAME"),
		ValidArgsFunction: a.completeContexts,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := a.loadConfig()
			if err != nil {
				return err
			}
			if cfg.Contexts[args[0]] == nil {
				return usagef("no context %q in %s", args[0], a.cfgPath)
			}
			delete(cfg.Contexts, args[0])
			if cfg.CurrentContext == args[0] {
				cfg.CurrentContext = ""
			}
			if err := cfg.Save(a.cfgPath); err != nil {
				return err
			}
			_, err = fmt.Fprintf(a.stdout, "context %s deleted\n", args[0])
			return err
		},
	}
}

func (a *app) completeContexts(_ *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
	if len(args) > 0 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	cfg, err := a.loadConfig()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	return cfg.Names(), cobra.ShellCompDirectiveNoFileComp
}
