package api

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func (s *Server) listProcesses(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		ps, err := s.eng.Processes(ctx, id)
		if err != nil {
			return err
		}
		if ps == nil {
			ps = []*model.Process{}
		}
		return writeJSON(w, http.StatusOK, client.ProcessList{Processes: ps})
	})
}

func (s *Server) getProcess(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		p, err := s.eng.Process(ctx, id, r.PathValue("handle"))
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, p)
	})
}

func (s *Server) removeProcess(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		if err := s.eng.RemoveProcess(ctx, id, r.PathValue("handle")); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func execOptions(req client.ExecRequest) (model.ExecOptions, error) {
	if len(req.Args) == 0 || req.Args[0] == "" {
		return model.ExecOptions{}, errdefs.InvalidArgument("\"args\" needs the command and its arguments, e.g. [\"python3\", \"-c\", \"print(1)\"]")
	}
	for _, kv := range req.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return model.ExecOptions{}, errdefs.InvalidArgument("env entry %q: write it as KEY=VALUE", kv)
		}
	}
	if req.TimeoutSeconds < 0 {
		return model.ExecOptions{}, errdefs.InvalidArgument("timeout_seconds %v: give a positive number", req.TimeoutSeconds)
	}
	return model.ExecOptions{Args: req.Args, Env: req.Env, Cwd: req.Cwd, Tty: req.Tty}, nil
}

func (s *Server) spawnProcess(w http.ResponseWriter, r *http.Request) error {
	var req client.ExecRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	opts, err := execOptions(req)
	if err != nil {
		return err
	}
	if req.Stdin != "" || req.TimeoutSeconds != 0 || req.Keep {
		return errdefs.InvalidArgument("stdin, timeout_seconds and keep are for POST .../exec; write to a background process with .../stdin, stop it with .../signal; its record stays until DELETE .../processes/{handle}")
	}
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		var h string
		if err := s.op("exec", func() (err error) { h, err = s.eng.Exec(ctx, id, opts); return }); err != nil {
			return err
		}
		p, err := s.eng.Process(ctx, id, h)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusCreated, p)
	})
}

func (s *Server) writeStdin(w http.ResponseWriter, r *http.Request) error {
	var req client.StdinRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	if req.Data != "" && len(req.DataBase64) > 0 {
		return errdefs.InvalidArgument("give data or data_base64, not both")
	}
	data := []byte(req.Data)
	if len(req.DataBase64) > 0 {
		data = req.DataBase64
	}
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		if err := s.eng.Stdin(ctx, id, r.PathValue("handle"), data, req.EOF); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// parseSignal reads "TERM", "SIGTERM", "term" or "15".
func parseSignal(s string) (syscall.Signal, error) {
	if n, err := strconv.Atoi(s); err == nil {
		if n <= 0 || n > 64 {
			return 0, errdefs.InvalidArgument("signal %d: give 1 to 64", n)
		}
		return syscall.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	return 0, errdefs.InvalidArgument("unknown signal %q (try TERM, KILL, INT, HUP, USR1 or a number)", s)
}

func (s *Server) signalProcess(w http.ResponseWriter, r *http.Request) error {
	var req client.SignalRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	sig, err := parseSignal(req.Signal)
	if err != nil {
		return err
	}
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		if err := s.eng.Signal(ctx, id, r.PathValue("handle"), sig); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

func (s *Server) waitProcess(w http.ResponseWriter, r *http.Request) error {
	var timeout time.Duration
	if v := r.URL.Query().Get("timeout_seconds"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f < 0 {
			return errdefs.InvalidArgument("timeout_seconds=%q: give a number of seconds", v)
		}
		timeout = time.Duration(f * float64(time.Second))
	}
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		h := r.PathValue("handle")
		wctx, cancel := s.streamCtx(ctx)
		defer cancel()
		if timeout > 0 {
			var c2 context.CancelFunc
			wctx, c2 = context.WithTimeout(wctx, timeout)
			defer c2()
		}
		s.metrics.streams.Inc()
		_, err := s.eng.Wait(wctx, id, h)
		s.metrics.streams.Dec()
		if err != nil && !(errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil) {
			return err
		}
		p, err := s.eng.Process(ctx, id, h)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, p)
	})
}

// processOutput streams a process's output from the given offsets (NDJSON).
func (s *Server) processOutput(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	follow, err := boolQuery(q, "follow")
	if err != nil {
		return err
	}
	var offs [2]int64
	for i, name := range []string{"stdout_offset", "stderr_offset"} {
		if v := q.Get(name); v != "" {
			if offs[i], err = strconv.ParseInt(v, 10, 64); err != nil || offs[i] < 0 {
				return errdefs.InvalidArgument("%s=%q: give a byte offset", name, v)
			}
		}
	}
	only := q.Get("stream")
	if only != "" && only != client.ChunkStdout && only != client.ChunkStderr {
		return errdefs.InvalidArgument("stream=%q: give stdout or stderr", only)
	}
	return s.sandboxCall(r, follow, func(ctx context.Context, id string) error {
		h := r.PathValue("handle")
		if _, err := s.eng.Process(ctx, id, h); err != nil {
			return err
		}
		n := newNDJSON(w)
		out := &outWriter{n: n, kind: client.ChunkStdout, skip: offs[0]}
		errw := &outWriter{n: n, kind: client.ChunkStderr, skip: offs[1]}
		out.only, errw.only = only, only
		s.metrics.streams.Inc()
		defer s.metrics.streams.Dec()
		var err error
		if follow {
			fctx, cancel := s.streamCtx(ctx)
			_, err = s.eng.Follow(fctx, id, h, out, errw)
			cancel()
		} else {
			err = s.copyOutput(ctx, id, h, out, errw)
		}
		out.flush()
		errw.flush()
		if err != nil {
			n.fail(err)
			return err
		}
		p, err := s.eng.Process(ctx, id, h)
		if err != nil {
			n.fail(err)
			return err
		}
		return n.send(client.Chunk{Type: client.ChunkEnd, Exit: p.Exit, StdoutOffset: out.off, StderrOffset: errw.off})
	})
}

// copyOutput writes what a process has output so far.
func (s *Server) copyOutput(ctx context.Context, id, h string, out, errw *outWriter) error {
	for _, o := range []*outWriter{out, errw} {
		if o.only != "" && o.only != o.kind {
			continue
		}
		off := o.skip
		o.off, o.skip = off, 0
		for {
			b, next, err := s.eng.Output(ctx, id, h, o.kind, off)
			if err != nil {
				return err
			}
			if len(b) == 0 {
				break
			}
			if _, err := o.Write(b); err != nil {
				return err
			}
			off = next
		}
	}
	return nil
}
