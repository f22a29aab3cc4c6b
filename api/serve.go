package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// DefaultSocket is where cairnd listens unless told otherwise.
const DefaultSocket = "/run/cairn/cairnd.sock"

// ServeConfig configures Serve.
type ServeConfig struct {
	Engine engine.Config
	API    Config
	// Socket is the unix socket (DefaultSocket; "none" for none). It is made mode 0660,
	// owned by root and by SocketGroup ("cairn") when that group exists.
	Socket      string
	SocketGroup string
	// TCP is an optional host:port to listen on as well; every request on it needs a
	// bearer token of Tokens.
	TCP    string
	Tokens []string
	// OnShutdown is "keep" (sandboxes keep running; the default) or "pause" (each is
	// checkpointed and stopped, and resumed by the next call that needs it).
	OnShutdown string
	// ShutdownTimeout bounds the wait for in-flight requests at shutdown (30s).
	ShutdownTimeout time.Duration
	// Ready, if set, is called once the listeners accept connections.
	Ready func()
}

// Serve opens the engine and serves the API until ctx ends, then shuts down
// gracefully: streams end, in-flight requests finish (up to ShutdownTimeout), and
// sandboxes keep running or are paused per OnShutdown.
func Serve(ctx context.Context, cfg ServeConfig) error {
	log := cfg.API.Logger
	if log == nil {
		log = slog.Default()
		cfg.API.Logger = log
	}
	switch cfg.OnShutdown {
	case "":
		cfg.OnShutdown = "keep"
	case "keep", "pause":
	default:
		return errdefs.InvalidArgument("--on-shutdown %q: give keep or pause", cfg.OnShutdown)
	}
	if cfg.TCP != "" && len(cfg.Tokens) == 0 {
		return errdefs.InvalidArgument("listening on TCP (%s) needs bearer tokens: give --token-file", cfg.TCP)
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 30 * time.Second
	}
	eng, err := engine.Open(ctx, cfg.Engine)
	if err != nil {
		return err
	}
	defer eng.Close()
	s, err := New(ctx, eng, cfg.API)
	if err != nil {
		return err
	}
	defer s.Close()
	servers, err := listen(cfg, s, log)
	if err != nil {
		return err
	}
	s.Start()
	errc := make(chan error, len(servers))
	for _, hs := range servers {
		go func() { errc <- hs.serve() }()
	}
	log.Info("cairnd serving", "data_dir", eng.DataDir(), "socket", cfg.Socket, "tcp", cfg.TCP,
		"default_ttl", s.cfg.DefaultTTL, "max_ttl", s.cfg.MaxTTL, "idle_timeout", s.cfg.IdleTimeout, "sandboxes", s.sessions.count())
	if cfg.Ready != nil {
		cfg.Ready()
	}
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	log.Info("cairnd shutting down", "on_shutdown", cfg.OnShutdown)
	s.Shutdown()
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	for _, hs := range servers {
		if err := hs.srv.Shutdown(sctx); err != nil {
			log.Warn("requests still running at shutdown were cut", "listener", hs.name, "err", err)
			hs.srv.Close()
		}
	}
	if cfg.OnShutdown == "pause" {
		s.PauseAll(context.Background())
	}
	log.Info("cairnd stopped")
	return serveErr
}

type httpServer struct {
	name string
	srv  *http.Server
	ln   net.Listener
}

func (h *httpServer) serve() error {
	if err := h.srv.Serve(h.ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("%s: %w", h.name, err)
	}
	return nil
}

func listen(cfg ServeConfig, s *Server, log *slog.Logger) ([]*httpServer, error) {
	mk := func(name string, ln net.Listener, h http.Handler) *httpServer {
		return &httpServer{name: name, ln: ln, srv: &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second,
			IdleTimeout: 5 * time.Minute, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}}
	}
	var out []*httpServer
	if cfg.Socket != "none" {
		if cfg.Socket == "" {
			cfg.Socket = DefaultSocket
		}
		ln, err := listenUnix(cfg.Socket, cfg.SocketGroup, log)
		if err != nil {
			return nil, err
		}
		out = append(out, mk("unix:"+cfg.Socket, ln, s))
	}
	if cfg.TCP != "" {
		ln, err := net.Listen("tcp", cfg.TCP)
		if err != nil {
			for _, o := range out {
				o.ln.Close()
			}
			return nil, fmt.Errorf("listen on %s: %w", cfg.TCP, err)
		}
		out = append(out, mk("tcp:"+ln.Addr().String(), ln, RequireToken(s, cfg.Tokens)))
	}
	if len(out) == 0 {
		return nil, errdefs.InvalidArgument("no listener: give a socket or --tcp")
	}
	return out, nil
}

// listenUnix listens on a unix socket readable and writable by root and group only.
// A stale socket (nobody accepting) is replaced; a live one means another cairnd.
func listenUnix(path, group string, log *slog.Logger) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, errdefs.AlreadyExists("another cairnd serves %s; stop it first or give --socket", path)
	}
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o660); err != nil {
		ln.Close()
		return nil, err
	}
	if group == "" {
		group = "cairn"
	}
	if g, err := user.LookupGroup(group); err == nil {
		gid, _ := strconv.Atoi(g.Gid)
		if err := os.Chown(path, 0, gid); err != nil {
			ln.Close()
			return nil, err
		}
	} else {
		log.Info("socket group does not exist: only root may use the socket", "group", group, "socket", path)
	}
	return ln, nil
}
