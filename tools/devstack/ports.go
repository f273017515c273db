package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"

	"github.com/leasehold/leasehold/pkg/pglocal"
)

// portFlag is one port of the dev stack: a flag with a LEASEHOLD_DEV_*
// environment fallback and a documented default. A port given explicitly
// must be free (or the stack refuses to start, naming it); the default is
// used when free and otherwise replaced by a free port, with a note.
type portFlag struct {
	what  string // "PostgreSQL", "api", …
	flag  string
	env   string
	def   int
	value int
}

func (p *portFlag) register(fs *flag.FlagSet) {
	fs.IntVar(&p.value, p.flag, 0, fmt.Sprintf("port of %s (env %s; default %d, or a free port when %d is busy)", p.what, p.env, p.def, p.def))
}

// explicit is the port asked for by flag or environment, 0 when none.
func (p *portFlag) explicit() (int, error) {
	if p.value != 0 {
		return p.value, checkRange(p.value, "-"+p.flag)
	}
	if v := os.Getenv(p.env); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, fmt.Errorf("%s=%q: want a port number", p.env, v)
		}
		return n, checkRange(n, p.env)
	}
	return 0, nil
}

func checkRange(n int, name string) error {
	if n < 1 || n > 65535 {
		return fmt.Errorf("%s %d: want a port in 1..65535", name, n)
	}
	return nil
}

// errPortBusy reports a port some other process listens on.
var errPortBusy = errors.New("port in use")

// portFree reports whether 127.0.0.1:port can be listened on now.
func portFree(port int) bool {
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

// portPicker hands out ports, never the same one twice.
type portPicker struct {
	taken map[int]bool
	notes []string
}

// pick returns the port for p, using want as its default (the documented
// port, or one derived from a base): an explicit port that is busy is an
// error naming it; a busy default is replaced by a free port and noted.
func (pp *portPicker) pick(p *portFlag, want int, explicit bool) (int, error) {
	if explicit {
		if pp.taken[want] || !portFree(want) {
			return 0, fmt.Errorf("%w: port %d for %s (-%s / %s) is already in use: stop what listens there (`ss -ltnp 'sport = :%d'` shows it) or choose another port",
				errPortBusy, want, p.what, p.flag, p.env, want)
		}
		pp.taken[want] = true
		return want, nil
	}
	if !pp.taken[want] && portFree(want) {
		pp.taken[want] = true
		return want, nil
	}
	for range 20 {
		free, err := pglocal.FreePort()
		if err != nil {
			return 0, err
		}
		if !pp.taken[free] {
			pp.taken[free] = true
			pp.notes = append(pp.notes, fmt.Sprintf("port %d for %s is busy: using %d instead (choose one with -%s or %s)", want, p.what, free, p.flag, p.env))
			return free, nil
		}
	}
	return 0, fmt.Errorf("no free port for %s", p.what)
}
