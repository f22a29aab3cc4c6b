package api

import (
	"encoding/json"
	"net/http"
	"sync"
	"unicode/utf8"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// ndjson writes Chunks as newline-delimited JSON, flushing each line.
type ndjson struct {
	mu  sync.Mutex
	w   http.ResponseWriter
	rc  *http.ResponseController
	enc *json.Encoder
}

func newNDJSON(w http.ResponseWriter) *ndjson {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	n := &ndjson{w: w, rc: http.NewResponseController(w), enc: json.NewEncoder(w)}
	n.enc.SetEscapeHTML(false)
	n.rc.Flush()
	return n
}

func (n *ndjson) send(c client.Chunk) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if err := n.enc.Encode(c); err != nil {
		return err
	}
	return n.rc.Flush()
}

// fail ends a stream that already started with an error line.
func (n *ndjson) fail(err error) {
	n.send(client.Chunk{Type: client.ChunkError, Code: errdefs.Code(err), Detail: err.Error()})
}

// outWriter turns one output stream into Chunks. It skips the first skip bytes (output
// the client already has), never splits a UTF-8 sequence across chunks, and sends
// bytes that are not UTF-8 as data_base64.
type outWriter struct {
	n     *ndjson
	kind  string
	skip  int64
	carry []byte
	off   int64  // offset reached, counting skipped bytes
	only  string // if set and not kind, the output is dropped
}

func (o *outWriter) Write(b []byte) (int, error) {
	n := len(b)
	o.off += int64(n)
	if o.only != "" && o.only != o.kind {
		return n, nil
	}
	if o.skip > 0 {
		d := min(o.skip, int64(len(b)))
		b, o.skip = b[d:], o.skip-d
	}
	if len(b) == 0 {
		return n, nil
	}
	data := append(o.carry, b...)
	cut := incompleteTail(data)
	o.carry = append([]byte(nil), data[cut:]...)
	if cut > 0 {
		if err := o.n.send(chunkOf(o.kind, data[:cut])); err != nil {
			return 0, err
		}
	}
	return n, nil
}

// flush sends what is held back (an incomplete sequence at the end of the output).
func (o *outWriter) flush() {
	if len(o.carry) > 0 {
		o.n.send(chunkOf(o.kind, o.carry))
		o.carry = nil
	}
}

func chunkOf(kind string, b []byte) client.Chunk {
	if utf8.Valid(b) {
		return client.Chunk{Type: kind, Data: string(b)}
	}
	return client.Chunk{Type: kind, DataBase64: append([]byte(nil), b...)}
}

// incompleteTail returns where a trailing, not yet complete UTF-8 sequence starts
// (len(b) if there is none).
func incompleteTail(b []byte) int {
	for i := len(b) - 1; i >= 0 && i >= len(b)-3; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return i
			}
			break
		}
	}
	return len(b)
}
