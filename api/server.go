// Package api is cairnd's HTTP API: versioned JSON routes over the engine (/v1/...),
// problem bodies for errors, NDJSON output streams, server-sent lifecycle events,
// sessions (TTL, idle pause), Prometheus metrics and the OpenAPI document
// (openapi.yaml, served at /v1/openapi.json).
//
// Handlers are thin: decode, acquire the sandbox's session (activity, transparent
// resume), call the engine, emit an event, encode. The engine serializes what must be
// serialized per sandbox (flocks); the API adds no lock of its own around engine calls,
// so an exec runs during another exec and the tree is read during a checkpoint.
package api

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	_ "embed"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/store"
)

// Config configures a Server. Zero durations take the defaults in parentheses.
type Config struct {
	DefaultTTL  time.Duration // (1h) TTL of a sandbox that asks for none
	MaxTTL      time.Duration // (24h) longest TTL a sandbox may ask for
	IdleTimeout time.Duration // (0: never) pause after this long without API activity
	// Tick is how often TTLs and idle timers are checked (1s).
	Tick time.Duration
	// PoolDir is the pool's mount point, for the pool usage metric (DataDir/pool).
	PoolDir string
	Version string
	Logger  *slog.Logger
}

// Server serves the API over an engine.
type Server struct {
	cfg      Config
	eng      *engine.Engine
	log      *slog.Logger
	sessions *sessions
	broker   *broker
	metrics  *metrics
	mux      *http.ServeMux
	poolDir  string
	started  time.Time

	// done is closed when the server shuts down: streams end (without killing the
	// processes they follow) and the session loop stops.
	done     chan struct{}
	doneOnce sync.Once
	stopCtx  context.Context // canceled with done
	stop     context.CancelFunc
	bg       sync.WaitGroup // the session loop and background process kills
}

// New makes a server over eng and loads the persisted sessions, reconciled with the
// engine's sandboxes. Start starts enforcing lifetimes; Close stops.
func New(ctx context.Context, eng *engine.Engine, cfg Config) (*Server, error) {
	if cfg.DefaultTTL == 0 {
		cfg.DefaultTTL = time.Hour
	}
	if cfg.MaxTTL == 0 {
		cfg.MaxTTL = 24 * time.Hour
	}
	if cfg.DefaultTTL > cfg.MaxTTL {
		return nil, errdefs.InvalidArgument("default TTL %s is over the maximum TTL %s", cfg.DefaultTTL, cfg.MaxTTL)
	}
	if cfg.Tick == 0 {
		cfg.Tick = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.PoolDir == "" {
		cfg.PoolDir = filepath.Join(eng.DataDir(), "pool")
	}
	db, err := store.OpenSessions(filepath.Join(eng.DataDir(), "cairn.db"))
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, eng: eng, log: cfg.Logger, broker: newBroker(), poolDir: cfg.PoolDir,
		started: time.Now(), done: make(chan struct{})}
	s.stopCtx, s.stop = context.WithCancel(context.Background())
	s.metrics = newMetrics(s)
	s.sessions = &sessions{eng: eng, db: db, broker: s.broker, metrics: s.metrics, log: cfg.Logger,
		defTTL: cfg.DefaultTTL, maxTTL: cfg.MaxTTL, idle: cfg.IdleTimeout, m: map[string]*tracked{}}
	if err := s.sessions.load(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("load sessions: %w", err)
	}
	s.mux = http.NewServeMux()
	for _, rt := range routes {
		s.mux.Handle(rt.pattern, s.wrap(rt.h))
	}
	return s, nil
}

// Start starts enforcing TTLs and idle timeouts.
func (s *Server) Start() {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		s.sessions.run(s.stopCtx, s.cfg.Tick)
	}()
}

// Shutdown ends the streams and the session loop. Preconditions: the HTTP servers no
// longer accept requests, or are being shut down.
func (s *Server) Shutdown() {
	s.doneOnce.Do(func() {
		close(s.done)
		s.stop()
	})
	s.bg.Wait()
}

// PauseAll checkpoints and stops every running sandbox (cairnd --on-shutdown pause);
// the next call that needs one resumes it.
func (s *Server) PauseAll(ctx context.Context) { s.sessions.pauseAll(ctx) }

// Close releases the sessions database (not the engine).
func (s *Server) Close() error { return s.sessions.db.Close() }

// wrap turns a handler returning an error into an http.Handler writing problems.
func (s *Server) wrap(h func(*Server, http.ResponseWriter, *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		err := h(s, w, r)
		if err == nil {
			return
		}
		if rec, ok := w.(*statusRecorder); ok && rec.status != 0 {
			return // a stream already reported it in-band
		}
		p := problemOf(err)
		if p.Status >= 500 && p.Status != 503 {
			s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "status", p.Status, "err", err)
		}
		writeProblem(w, err)
	})
}

// ServeHTTP routes a request: problems for unknown routes (404) and wrong methods
// (405), metrics by route, a 500 problem for a panic.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rec := &statusRecorder{ResponseWriter: w}
	h, pattern := s.mux.Handler(r)
	route := pattern
	if route == "" {
		route = "unmatched"
	}
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			s.log.Error("handler panic", "route", route, "panic", v)
			if rec.status == 0 {
				writeProblem(rec, fmt.Errorf("internal error: %v", v))
			}
		}
		s.metrics.httpReqs.WithLabelValues(route, rec.code()).Inc()
		s.metrics.httpDur.WithLabelValues(route).Observe(time.Since(start).Seconds())
	}()
	if pattern == "" {
		s.noRoute(rec, r, h)
		return
	}
	s.mux.ServeHTTP(rec, r)
}

// headerRecorder captures what the mux's own 404/405/redirect handler would write.
type headerRecorder struct {
	h      http.Header
	status int
}

func (h *headerRecorder) Header() http.Header         { return h.h }
func (h *headerRecorder) Write(b []byte) (int, error) { return len(b), nil }
func (h *headerRecorder) WriteHeader(code int)        { h.status = code }

func (s *Server) noRoute(w http.ResponseWriter, r *http.Request, h http.Handler) {
	probe := &headerRecorder{h: http.Header{}}
	h.ServeHTTP(probe, r)
	switch probe.status {
	case http.StatusMethodNotAllowed:
		allow := probe.h.Get("Allow")
		w.Header().Set("Allow", allow)
		writeProblem(w, withStatus(http.StatusMethodNotAllowed,
			errdefs.InvalidArgument("method %s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, allow)))
	case http.StatusNotFound, 0:
		writeProblem(w, errdefs.NotFound("no route %s %s in this API (see /v1/openapi.json)", r.Method, r.URL.Path))
	default:
		h.ServeHTTP(w, r) // the mux's redirect to a cleaned path
	}
}

// RequireToken wraps h so that every request needs "Authorization: Bearer TOKEN" with
// one of tokens (the TCP listener's handler).
func RequireToken(h http.Handler, tokens []string) http.Handler {
	sums := make([][32]byte, len(tokens))
	for i, t := range tokens {
		sums[i] = sha256.Sum256([]byte(t))
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		sum := sha256.Sum256([]byte(strings.TrimSpace(got)))
		match := 0
		for _, want := range sums {
			match |= subtle.ConstantTimeCompare(sum[:], want[:])
		}
		if !ok || match != 1 {
			writeProblem(w, withStatus(http.StatusUnauthorized,
				errdefs.PermissionDenied("this listener needs \"Authorization: Bearer TOKEN\" with a token of cairnd --token-file (set CAIRN_TOKEN for the SDKs and the CLI)")))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// streamCtx is ctx canceled also when the server shuts down.
func (s *Server) streamCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.stopCtx, cancel)
	return ctx, func() { stop(); cancel() }
}

func (s *Server) shuttingDown() bool { return s.stopCtx.Err() != nil }
