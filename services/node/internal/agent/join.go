package agent

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	enrollv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1/enrollv1connect"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/reload"
)

// JoinTokenEnv is the environment variable a join token may come from, so
// it need not appear on a command line.
const JoinTokenEnv = "LEASEHOLD_JOIN_TOKEN"

// enrollFlags are the flags join and rotate-credential share.
type enrollFlags struct {
	apiURL   string
	stateDir string
	tls      reload.ClientTLSFiles
	timeout  time.Duration
}

func (e *enrollFlags) register(f *flag.FlagSet) {
	f.StringVar(&e.apiURL, "api-url", "", "leasehold-api base URL, e.g. https://leasehold.example.net:8080 (required)")
	f.StringVar(&e.stateDir, "state-dir", DefaultStateDir, "state directory of the agent (credential and node id are written here)")
	e.tls.RegisterFlags("", f)
	f.DurationVar(&e.timeout, "timeout", 30*time.Second, "bound of the call")
}

func (e *enrollFlags) validate() error {
	var errs []error
	if !strings.HasPrefix(e.apiURL, "https://") && !strings.HasPrefix(e.apiURL, "http://") {
		errs = append(errs, fmt.Errorf("--api-url %q must start with https:// or http://", e.apiURL))
	}
	if !filepath.IsAbs(e.stateDir) {
		errs = append(errs, fmt.Errorf("--state-dir %q must be an absolute path", e.stateDir))
	}
	if e.timeout <= 0 {
		errs = append(errs, fmt.Errorf("--timeout %s must be positive", e.timeout))
	}
	return errors.Join(errs...)
}

func (e *enrollFlags) client() (enrollv1connect.EnrollmentServiceClient, error) {
	hc := &http.Client{Timeout: e.timeout}
	if strings.HasPrefix(e.apiURL, "https://") {
		t, err := reload.NewClientTLS("join", e.tls, reload.Options{})
		if err != nil {
			return nil, err
		}
		hc.Transport = &http.Transport{TLSClientConfig: t.Config(), ForceAttemptHTTP2: true}
	}
	return enrollv1connect.NewEnrollmentServiceClient(hc, strings.TrimRight(e.apiURL, "/")), nil
}

// JoinCommand is `leasehold-node join`: it exchanges a join token for this
// machine's node credential and writes the credential (0600) and the node
// id into the state directory, where the agent reads them. It returns the
// exit status: 0 joined, 1 refused or failed, 2 bad usage.
func JoinCommand(args []string, stdout, stderr io.Writer) int {
	f := flag.NewFlagSet("leasehold-node join", flag.ContinueOnError)
	f.SetOutput(stderr)
	var (
		e         enrollFlags
		token     string
		tokenFile string
		nodeID    string
		labels    Labels
	)
	e.register(f)
	f.StringVar(&tokenFile, "token-file", "", "file holding the join token (or set "+JoinTokenEnv+")")
	f.StringVar(&nodeID, "node-id", "", "the id to join as (default: the short hostname, else /etc/machine-id)")
	f.Var(&labels, "label", "label this machine reports, key=value (repeatable; the join token's labels win)")
	if err := f.Parse(args); err != nil {
		return 2
	}
	if err := lifecycle.ApplyEnv(f); err != nil {
		fmt.Fprintf(stderr, "leasehold-node join: %v\n", err)
		return 2
	}
	token = os.Getenv(JoinTokenEnv)
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold-node join: --token-file: %v\n", err)
			return 2
		}
		token = strings.TrimSpace(string(b))
	}
	usage := e.validate()
	if token == "" {
		usage = errors.Join(usage, fmt.Errorf("a join token is required: --token-file or %s", JoinTokenEnv))
	}
	if usage != nil {
		fmt.Fprintf(stderr, "leasehold-node join: %v\n", usage)
		return 2
	}
	credFile := filepath.Join(e.stateDir, credentialFileName)
	if _, err := os.Stat(credFile); err == nil {
		fmt.Fprintf(stderr, "leasehold-node join: %s exists: this machine has joined already (remove it to join again; a node that exists needs an admin's AllowReenroll)\n", credFile)
		return 1
	} else if !errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintf(stderr, "leasehold-node join: %v\n", err)
		return 1
	}
	if err := ensureStateDir(e.stateDir); err != nil {
		fmt.Fprintf(stderr, "leasehold-node join: %v\n", err)
		return 1
	}
	if nodeID == "" {
		id, err := DefaultNodeID(e.stateDir)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold-node join: --node-id: %v\n", err)
			return 2
		}
		nodeID = id
	}
	c, err := e.client()
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-node join: %v\n", err)
		return 2
	}
	host, _ := os.Hostname()
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	resp, err := c.Join(ctx, connect.NewRequest(&enrollv1.JoinRequest{Token: token, NodeId: nodeID, Hostname: host, Labels: labels}))
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-node join: %s\n", describe(err))
		return 1
	}
	if err := writeFileAtomic(credFile, []byte(resp.Msg.GetCredential()+"\n"), 0o600); err != nil {
		fmt.Fprintf(stderr, "leasehold-node join: joined as %s but could not store the credential: %v\n", resp.Msg.GetNodeId(), err)
		return 1
	}
	if err := writeFileAtomic(filepath.Join(e.stateDir, nodeIDFileName), []byte(resp.Msg.GetNodeId()+"\n"), 0o644); err != nil {
		fmt.Fprintf(stderr, "leasehold-node join: %v\n", err)
		return 1
	}
	verb := "joined"
	if resp.Msg.GetReenrolled() {
		verb = "re-enrolled"
	}
	fmt.Fprintf(stdout, "%s as node %s; credential written to %s\n", verb, resp.Msg.GetNodeId(), credFile)
	return 0
}

// RotateCommand is `leasehold-node rotate-credential`: it asks the api for
// a new credential with the current one and replaces the credential file
// atomically. A running agent uses the new credential from its next Hello
// on; its open session, authenticated with the old one, goes on, and the
// old credential keeps working for --grace, so no session is lost.
func RotateCommand(args []string, stdout, stderr io.Writer) int {
	f := flag.NewFlagSet("leasehold-node rotate-credential", flag.ContinueOnError)
	f.SetOutput(stderr)
	var (
		e      enrollFlags
		grace  time.Duration
		nodeID string
	)
	e.register(f)
	f.DurationVar(&grace, "grace", 10*time.Minute, "how long the current credential keeps working (0..24h)")
	f.StringVar(&nodeID, "node-id", "", "this node's id (default: the id it joined as)")
	if err := f.Parse(args); err != nil {
		return 2
	}
	if err := lifecycle.ApplyEnv(f); err != nil {
		fmt.Fprintf(stderr, "leasehold-node rotate-credential: %v\n", err)
		return 2
	}
	usage := e.validate()
	if grace < 0 || grace > 24*time.Hour {
		usage = errors.Join(usage, fmt.Errorf("--grace %s must be within 0..24h", grace))
	}
	if usage != nil {
		fmt.Fprintf(stderr, "leasehold-node rotate-credential: %v\n", usage)
		return 2
	}
	if nodeID == "" {
		id, err := DefaultNodeID(e.stateDir)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold-node rotate-credential: --node-id: %v\n", err)
			return 2
		}
		nodeID = id
	}
	credFile := filepath.Join(e.stateDir, credentialFileName)
	cred, err := ReadCredential(credFile)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-node rotate-credential: %v\n", err)
		return 1
	}
	c, err := e.client()
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-node rotate-credential: %v\n", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	resp, err := c.RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{
		NodeId: nodeID, Credential: cred, Grace: durationpb.New(grace)}))
	if err != nil {
		fmt.Fprintf(stderr, "leasehold-node rotate-credential: %s\n", describe(err))
		return 1
	}
	if err := writeFileAtomic(credFile, []byte(resp.Msg.GetCredential()+"\n"), 0o600); err != nil {
		fmt.Fprintf(stderr, "leasehold-node rotate-credential: the new credential could not be stored (the old one works until %s): %v\n",
			resp.Msg.GetOldValidUntil().AsTime().Format(time.RFC3339), err)
		return 1
	}
	fmt.Fprintf(stdout, "rotated the credential of node %s; the previous one works until %s\n",
		nodeID, resp.Msg.GetOldValidUntil().AsTime().Format(time.RFC3339))
	return 0
}

// describe prints a Connect error as its code and the server's message.
func describe(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Sprintf("%s: %s", ce.Code(), ce.Message())
	}
	return err.Error()
}
