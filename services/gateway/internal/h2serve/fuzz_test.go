package h2serve

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// fuzzSeeds are client byte streams (after the preface): valid requests,
// control frames and broken ones.
func fuzzSeeds(t testing.TB) [][]byte {
	var seeds [][]byte
	frames := func(fn func(fr *http2.Framer, enc *hpack.Encoder, hb *bytes.Buffer)) {
		var buf, hb bytes.Buffer
		fr := http2.NewFramer(&buf, nil)
		fr.AllowIllegalWrites = true
		fn(fr, hpack.NewEncoder(&hb), &hb)
		seeds = append(seeds, buf.Bytes())
	}
	request := func(enc *hpack.Encoder, hb *bytes.Buffer, path string) []byte {
		hb.Reset()
		for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", "x"}, {":path", path}, {"content-type", "application/proto"}} {
			if err := enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}); err != nil {
				t.Fatal(err)
			}
		}
		return append([]byte(nil), hb.Bytes()...)
	}
	frames(func(fr *http2.Framer, _ *hpack.Encoder, _ *bytes.Buffer) { _ = fr.WriteSettings() })
	frames(func(fr *http2.Framer, enc *hpack.Encoder, hb *bytes.Buffer) {
		_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 10})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: request(enc, hb, "/echo"), EndHeaders: true})
		_ = fr.WriteData(1, true, []byte("hello"))
		_ = fr.WriteWindowUpdate(1, 100)
		_ = fr.WriteWindowUpdate(0, 100)
		_ = fr.WritePing(false, [8]byte{1})
	})
	frames(func(fr *http2.Framer, enc *hpack.Encoder, hb *bytes.Buffer) {
		_ = fr.WriteSettings()
		block := request(enc, hb, "/echo")
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: block[:3]})
		_ = fr.WriteContinuation(3, true, block[3:])
		_ = fr.WriteRSTStream(3, http2.ErrCodeCancel)
		_ = fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	})
	frames(func(fr *http2.Framer, enc *hpack.Encoder, hb *bytes.Buffer) {
		_ = fr.WriteSettings()
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: request(enc, hb, "/echo"), EndHeaders: true, EndStream: true})
		_ = fr.WritePriority(1, http2.PriorityParam{StreamDep: 1})
		_ = fr.WriteData(1, false, []byte("after end"))
	})
	seeds = append(seeds, []byte("garbage that is no frame at all"), []byte{0, 0, 0, 4, 0, 0, 0, 0, 0})
	return seeds
}

// FuzzServeConn feeds arbitrary bytes after the client preface to one
// connection: the server must neither panic nor hang, and must leave no
// goroutine behind (goleak in TestMain).
func FuzzServeConn(f *testing.F) {
	for _, s := range fuzzSeeds(f) {
		f.Add(s)
	}
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-T")
		_, _ = io.Copy(w, r.Body)
		w.Header().Set("X-T", "t")
	})
	f.Fuzz(func(t *testing.T, data []byte) {
		srv := &Server{Handler: echo, ReadHeaderTimeout: time.Second, WriteTimeout: 200 * time.Millisecond, PingInterval: -1}
		client, server := net.Pipe()
		done := make(chan struct{})
		go func() {
			srv.serveConn(server)
			close(done)
		}()
		drained := make(chan struct{})
		go func() {
			_, _ = io.Copy(io.Discard, client)
			close(drained)
		}()
		_ = client.SetWriteDeadline(time.Now().Add(time.Second))
		_, _ = client.Write(append([]byte(http2.ClientPreface), data...))
		time.Sleep(time.Millisecond) // the client goes away while the server reads, not before
		_ = client.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("connection not closed after the client went away")
		}
		<-drained
		_ = srv.Close()
		srv.Wait()
	})
}
