// Command cairnd is cairn's daemon: it serves the HTTP API (package api) on a unix
// socket, and optionally on TCP with bearer tokens, in the foreground. With no flags it
// runs with embedded defaults: data in /var/lib/cairn, socket /run/cairn/cairnd.sock.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/api"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/memtune"
	"github.com/cairn-sandbox/cairn/template"
)

var version = "dev"

func main() {
	memtune.Apply()
	var (
		cfg       api.ServeConfig
		tokenFile string
		logJSON   bool
		logLevel  string
	)
	flag.StringVar(&cfg.Engine.DataDir, "data-dir", envOr("CAIRN_DATA_DIR", engine.DefaultDataDir), "state directory (env CAIRN_DATA_DIR)")
	flag.StringVar(&cfg.Engine.PoolDir, "pool-dir", os.Getenv("CAIRN_POOL_DIR"), "btrfs pool mount point (default DATA_DIR/pool)")
	flag.StringVar(&cfg.Engine.PoolImage, "pool-image", os.Getenv("CAIRN_POOL_IMAGE"), `pool image file, "none" to use --pool-dir as is`)
	flag.StringVar(&cfg.Engine.ImagePool, "image-pool", os.Getenv("CAIRN_IMAGE_POOL"), `image file of the btrfs filesystem for process images (default DATA_DIR/imgs.img), "none" to keep them on the data directory's filesystem, in incremental chains`)
	flag.StringVar(&cfg.Socket, "socket", envOr("CAIRND_SOCKET", api.DefaultSocket), `unix socket to serve on ("none": no socket)`)
	flag.StringVar(&cfg.SocketGroup, "socket-group", "cairn", "group allowed to use the socket (if it exists)")
	flag.StringVar(&cfg.TCP, "tcp", "", "also serve on this TCP host:port (needs --token-file)")
	flag.StringVar(&tokenFile, "token-file", "", "file of bearer tokens for TCP, one per line")
	flag.DurationVar(&cfg.API.DefaultTTL, "default-ttl", time.Hour, "TTL of a sandbox that asks for none")
	flag.DurationVar(&cfg.API.MaxTTL, "max-ttl", 24*time.Hour, "longest TTL a sandbox may ask for")
	flag.DurationVar(&cfg.API.IdleTimeout, "idle-timeout", 30*time.Minute, "pause a sandbox after this long without API activity (0: never)")
	flag.DurationVar(&cfg.API.Tick, "session-tick", time.Second, "advanced: how often TTLs and idle timers are checked")
	flag.IntVar(&cfg.Engine.StandbyRestores, "standby-restores", 1, "standby restores run at once in the background: more keep more standbys ready for rollbacks and forks, at some cost to checkpoint latency")
	flag.IntVar(&cfg.Engine.Residents, "residents", engine.DefaultResidents, "checkpoints of each sandbox kept resident (their processes held as frozen copy-on-write copies, so that a rollback forks them instead of restoring images) once written to disk; -1: none")
	flag.Int64Var(&cfg.Engine.ResidentMemory, "resident-memory", 0, "bytes of memory the resident checkpoints of one sandbox may hold beyond its processes' (it counts against the sandbox's memory limit); beyond it the least likely rollback targets are evicted to their images. 0: a quarter of the sandbox's memory limit; -1: no bound but --residents")
	flag.StringVar(&cfg.OnShutdown, "on-shutdown", "keep", "what happens to running sandboxes at shutdown: keep or pause")
	flag.BoolVar(&logJSON, "log-json", false, "log JSON lines instead of text")
	flag.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	showVersion := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *showVersion {
		fmt.Println(version)
		return
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(logLevel)); err != nil {
		fail(errdefs.InvalidArgument("--log-level %q: give debug, info, warn or error", logLevel))
	}
	hopts := &slog.HandlerOptions{Level: level}
	var h slog.Handler = slog.NewTextHandler(os.Stderr, hopts)
	if logJSON {
		h = slog.NewJSONHandler(os.Stderr, hopts)
	}
	cfg.API.Logger, cfg.API.Version = slog.New(h), version
	cfg.Engine.Progress = template.NewBarProgress(os.Stderr)
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			fail(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				cfg.Tokens = append(cfg.Tokens, l)
			}
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := api.Serve(ctx, cfg); err != nil {
		fail(err)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "cairnd: %v\n", err)
	os.Exit(errdefs.ExitCode(err))
}
