package tftp

import (
	"strconv"
	"testing"
	"time"
)

// FuzzParseRequest feeds arbitrary bytes to the request parser and the
// option negotiation: they never panic, a request over 512 bytes is always
// refused, and whatever is negotiated stays within the server's bounds.
func FuzzParseRequest(f *testing.F) {
	f.Add(rrq(opRRQ, "ipxe.efi", "octet", "tsize", "0", "blksize", "1468"))
	f.Add(rrq(opWRQ, "x", "netascii"))
	f.Add(rrq(opRRQ, "f", "octet", "timeout", "255", "windowsize", "16"))
	f.Add([]byte{0, 1, 0})
	s := &Server{cfg: Config{MaxBlockSize: 1468, Timeout: time.Second}}
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := parseRequest(b)
		if err != nil {
			return
		}
		if len(b) > MaxRequestBytes {
			t.Fatalf("accepted a %d-byte request", len(b))
		}
		blk, timeout, acc := s.negotiate(req, 12345)
		if blk < 8 || blk > 1468 || timeout < time.Second || timeout > 255*time.Second {
			t.Fatalf("negotiated blksize %d timeout %s", blk, timeout)
		}
		for name, v := range acc {
			if _, ok := req.options[name]; !ok {
				t.Fatalf("OACK holds %q, which the client did not ask for", name)
			}
			if _, err := strconv.Atoi(v); err != nil {
				t.Fatalf("OACK value %q of %s is not a number", v, name)
			}
		}
		if len(oackPacket(req.order, acc)) > 2+len(b) {
			t.Fatalf("OACK larger than the request")
		}
	})
}
