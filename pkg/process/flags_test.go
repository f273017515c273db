package process_test

import (
	"flag"
	"io"

	"github.com/leasehold/leasehold/pkg/process"
)

func newFlagSet(cfg *process.Config) *flag.FlagSet {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.RegisterFlags("", fs)
	return fs
}
