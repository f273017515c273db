package tftp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Opcodes (RFC 1350, RFC 2347).
const (
	opRRQ   uint16 = 1
	opWRQ   uint16 = 2
	opDATA  uint16 = 3
	opACK   uint16 = 4
	opERROR uint16 = 5
	opOACK  uint16 = 6
)

// Error codes (RFC 1350, RFC 2347).
const (
	errNotDefined    uint16 = 0
	errFileNotFound  uint16 = 1
	errAccess        uint16 = 2
	errIllegalOp     uint16 = 4
	errOptionRefused uint16 = 8
)

// MaxRequestBytes bounds a request packet: RFC 1350 packets of a request
// fit in 512 bytes, and so do the RFC 2347 options ("the request packet
// ... must not exceed 512 octets").
const MaxRequestBytes = 512

// request is a parsed RRQ or WRQ.
type request struct {
	op       uint16
	filename string
	mode     string
	// options in the order sent, names lowercased.
	options map[string]string
	order   []string
}

// parseRequest parses a read or write request. It refuses anything that is
// not NUL-terminated strings, duplicate options, and options without value.
func parseRequest(b []byte) (request, error) {
	if len(b) < 4 {
		return request{}, errors.New("packet shorter than 4 bytes")
	}
	if len(b) > MaxRequestBytes {
		return request{}, fmt.Errorf("request of %d bytes exceeds %d", len(b), MaxRequestBytes)
	}
	r := request{op: binary.BigEndian.Uint16(b), options: map[string]string{}}
	if r.op != opRRQ && r.op != opWRQ {
		return r, fmt.Errorf("opcode %d is not a request", r.op)
	}
	rest := b[2:]
	if len(rest) == 0 || rest[len(rest)-1] != 0 {
		return r, errors.New("request does not end with NUL")
	}
	fields := bytes.Split(rest[:len(rest)-1], []byte{0})
	if len(fields) < 2 || len(fields)%2 != 0 {
		return r, errors.New("request is not filename, mode and option/value pairs")
	}
	r.filename, r.mode = string(fields[0]), strings.ToLower(string(fields[1]))
	for i := 2; i < len(fields); i += 2 {
		name := strings.ToLower(string(fields[i]))
		if name == "" {
			return r, errors.New("empty option name")
		}
		if _, dup := r.options[name]; dup {
			return r, fmt.Errorf("option %q given twice", name)
		}
		r.options[name] = string(fields[i+1])
		r.order = append(r.order, name)
	}
	return r, nil
}

// optionInt parses an option's decimal value.
func optionInt(v string) (int, bool) {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}

func dataPacket(block uint16, payload []byte) []byte {
	p := make([]byte, 4+len(payload))
	binary.BigEndian.PutUint16(p, opDATA)
	binary.BigEndian.PutUint16(p[2:], block)
	copy(p[4:], payload)
	return p
}

func errorPacket(code uint16, msg string) []byte {
	p := make([]byte, 4, 5+len(msg))
	binary.BigEndian.PutUint16(p, opERROR)
	binary.BigEndian.PutUint16(p[2:], code)
	p = append(p, msg...)
	return append(p, 0)
}

// oackPacket lists the accepted options in the order the client sent them.
func oackPacket(order []string, accepted map[string]string) []byte {
	p := []byte{0, byte(opOACK)}
	for _, name := range order {
		v, ok := accepted[name]
		if !ok {
			continue
		}
		p = append(p, name...)
		p = append(p, 0)
		p = append(p, v...)
		p = append(p, 0)
	}
	return p
}
