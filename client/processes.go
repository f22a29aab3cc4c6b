package client

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/url"
	"strconv"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
)

func procPath(id, h string, rest ...string) string {
	return sbPath(id, append([]string{"processes", pathEsc(h)}, rest...)...)
}

// Spawn starts a process in the background; its standard input stays open.
func (c *Client) Spawn(ctx context.Context, id string, req ExecRequest) (*Process, error) {
	var p Process
	return &p, c.call(ctx, request{method: "POST", path: sbPath(id, "processes"), body: req}, &p)
}

// Processes lists the processes started in a sandbox.
func (c *Client) Processes(ctx context.Context, id string) ([]*Process, error) {
	var l ProcessList
	return l.Processes, c.call(ctx, request{method: "GET", path: sbPath(id, "processes")}, &l)
}

// Process returns one process.
func (c *Client) Process(ctx context.Context, id, h string) (*Process, error) {
	var p Process
	return &p, c.call(ctx, request{method: "GET", path: procPath(id, h)}, &p)
}

// Stdin writes data to a process's standard input, closing it after if eof.
func (c *Client) Stdin(ctx context.Context, id, h string, data []byte, eof bool) error {
	return c.call(ctx, request{method: "POST", path: procPath(id, h, "stdin"), body: StdinRequest{DataBase64: data, EOF: eof}}, nil)
}

// Signal sends a signal to a process and its process group.
func (c *Client) Signal(ctx context.Context, id, h string, sig syscall.Signal) error {
	return c.call(ctx, request{method: "POST", path: procPath(id, h, "signal"), body: SignalRequest{Signal: strconv.Itoa(int(sig))}}, nil)
}

// RemoveProcess deletes the record (output, exit status) of an exited process.
func (c *Client) RemoveProcess(ctx context.Context, id, h string) error {
	return c.call(ctx, request{method: "DELETE", path: procPath(id, h)}, nil)
}

// Wait waits for a process to exit (as long as ctx lasts).
func (c *Client) Wait(ctx context.Context, id, h string) (*ExitStatus, error) {
	for {
		p, err := c.WaitTimeout(ctx, id, h, 0)
		if err != nil {
			return nil, err
		}
		if p.Exit != nil {
			return p.Exit, nil
		}
		if !p.Running {
			return nil, errdefs.Unavailable("sandbox %s stopped while process %s was running", id, h)
		}
	}
}

// WaitTimeout waits up to timeout (0: as long as ctx lasts) and returns the process;
// Exit is nil if it still runs.
func (c *Client) WaitTimeout(ctx context.Context, id, h string, timeout time.Duration) (*Process, error) {
	q := url.Values{}
	if timeout > 0 {
		q.Set("timeout_seconds", strconv.FormatFloat(timeout.Seconds(), 'f', -1, 64))
	}
	var p Process
	return &p, c.call(ctx, request{method: "POST", path: procPath(id, h, "wait"), query: q}, &p)
}

// Follow streams a process's output to the writers until it exits and returns its
// exit status. Cancelling ctx ends the stream only; the process keeps running.
func (c *Client) Follow(ctx context.Context, id, h string, stdout, stderr io.Writer) (*ExitStatus, error) {
	q := url.Values{"follow": {"true"}}
	end, err := c.stream(ctx, request{method: "GET", path: procPath(id, h, "output"), query: q}, stdout, stderr, nil)
	if err != nil {
		return nil, err
	}
	return end.Exit, nil
}

// Output reads one output stream ("stdout" or "stderr") from offset on, and returns the
// bytes and the offset to continue from.
func (c *Client) Output(ctx context.Context, id, h, stream string, offset int64) ([]byte, int64, error) {
	q := url.Values{"stream": {stream}, stream + "_offset": {strconv.FormatInt(offset, 10)}}
	var buf bytesWriter
	var outW, errW io.Writer
	switch stream {
	case "stdout":
		outW = &buf
	case "stderr":
		errW = &buf
	default:
		return nil, offset, errdefs.InvalidArgument("stream %q: give stdout or stderr", stream)
	}
	if _, err := c.stream(ctx, request{method: "GET", path: procPath(id, h, "output"), query: q}, outW, errW, nil); err != nil {
		return nil, offset, err
	}
	return buf.b, offset + int64(len(buf.b)), nil
}

type bytesWriter struct{ b []byte }

func (w *bytesWriter) Write(p []byte) (int, error) { w.b = append(w.b, p...); return len(p), nil }

// RunResult is the outcome of Run.
type RunResult struct {
	Handle   string
	ExitCode int
	Signal   int
	TimedOut bool
}

// Run runs a command, streams its output to the writers (nil: discard) and returns its
// exit status. Cancelling ctx kills the process (SIGTERM, then SIGKILL).
func (c *Client) Run(ctx context.Context, id string, req ExecRequest, stdout, stderr io.Writer) (*RunResult, error) {
	res := &RunResult{}
	end, err := c.stream(ctx, request{method: "POST", path: sbPath(id, "exec"), body: req}, stdout, stderr,
		func(h string) { res.Handle = h })
	if err != nil {
		return res, err
	}
	if end.Exit != nil {
		res.ExitCode, res.Signal = end.Exit.Code, end.Exit.Signal
	}
	res.TimedOut = end.TimedOut
	return res, nil
}

// stream reads an NDJSON output stream until its end line.
func (c *Client) stream(ctx context.Context, rq request, stdout, stderr io.Writer, started func(string)) (*Chunk, error) {
	resp, err := c.send(ctx, rq)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(resp.Body)
	for {
		var ch Chunk
		if err := dec.Decode(&ch); err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, errdefs.Unavailable("cairnd at %s: the output stream broke before its end: %v", c.where, err)
		}
		switch ch.Type {
		case ChunkStarted:
			if started != nil {
				started(ch.Handle)
			}
		case ChunkStdout, ChunkStderr:
			w := stdout
			if ch.Type == ChunkStderr {
				w = stderr
			}
			if w != nil {
				if ch.DataBase64 != nil {
					w.Write(ch.DataBase64)
				} else {
					io.WriteString(w, ch.Data)
				}
			}
		case ChunkEnd:
			return &ch, nil
		case ChunkError:
			return nil, &Error{Status: 200, Code: ch.Code, Detail: ch.Detail}
		}
	}
}
