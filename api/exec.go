package api

import (
	"context"
	"errors"
	"net/http"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// killGrace is how long a process whose exec stream was abandoned gets between SIGTERM
// and SIGKILL.
const killGrace = 2 * time.Second

// execStream runs a command and streams its output (POST .../exec). A client that
// disconnects takes its process with it; a daemon that shuts down does not. The
// process's record is removed after its end, unless the request says keep.
func (s *Server) execStream(w http.ResponseWriter, r *http.Request) error {
	var req client.ExecRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	opts, err := execOptions(req)
	if err != nil {
		return err
	}
	opts.NoStdin = req.Stdin == ""
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		var h string
		if err := s.op("exec", func() (err error) { h, err = s.eng.Exec(ctx, id, opts); return }); err != nil {
			return err
		}
		n := newNDJSON(w)
		if err := n.send(client.Chunk{Type: client.ChunkStarted, Handle: h}); err != nil {
			s.abandon(id, h)
			return nil
		}
		s.metrics.streams.Inc()
		defer s.metrics.streams.Dec()
		if req.Stdin != "" {
			// A process that exits without reading its input refuses it: not an error.
			s.eng.Stdin(ctx, id, h, []byte(req.Stdin), true)
		}
		fctx, cancel := s.streamCtx(ctx)
		defer cancel()
		if req.TimeoutSeconds > 0 {
			var c2 context.CancelFunc
			fctx, c2 = context.WithTimeout(fctx, time.Duration(req.TimeoutSeconds*float64(time.Second)))
			defer c2()
		}
		out := &outWriter{n: n, kind: client.ChunkStdout}
		errw := &outWriter{n: n, kind: client.ChunkStderr}
		st, err := s.eng.Follow(fctx, id, h, out, errw)
		timedOut := errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil && !s.shuttingDown()
		switch {
		case timedOut:
			s.eng.Signal(ctx, id, h, syscall.SIGKILL)
			// Follow streams from the start again: skip what was already sent.
			out.skip, out.off = out.off, 0
			errw.skip, errw.off = errw.off, 0
			st, err = s.eng.Follow(ctx, id, h, out, errw) // the rest of the output and the status
		case err != nil && ctx.Err() != nil:
			s.abandon(id, h)
			return nil
		case err != nil && s.shuttingDown():
			out.flush()
			errw.flush()
			n.fail(errdefs.Unavailable("cairnd is shutting down; process %s keeps running (follow it with GET .../processes/%s/output?follow=true)", h, h))
			return nil
		}
		out.flush()
		errw.flush()
		if err != nil {
			n.fail(err)
			return err
		}
		if !req.Keep {
			// The stream carried everything of it: its record goes (see RemoveProcess).
			s.eng.RemoveProcess(ctx, id, h)
		}
		return n.send(client.Chunk{Type: client.ChunkEnd, Exit: st, TimedOut: timedOut, StdoutOffset: out.off, StderrOffset: errw.off})
	})
}

// abandon ends the process of an exec stream whose client went away: SIGTERM, then
// SIGKILL if it still runs after killGrace. It runs in the background, bounded by
// killGrace and the server's lifetime.
func (s *Server) abandon(id, h string) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), killGrace+5*time.Second)
		defer cancel()
		if s.eng.Signal(ctx, id, h, syscall.SIGTERM) != nil {
			return
		}
		wctx, wcancel := context.WithTimeout(ctx, killGrace)
		_, err := s.eng.Wait(wctx, id, h)
		wcancel()
		if err != nil {
			s.eng.Signal(ctx, id, h, syscall.SIGKILL)
		}
	}()
}
