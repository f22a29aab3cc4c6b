// Command cairn is the command-line interface of cairn, a sandbox runtime whose
// sandboxes (a filesystem and a process tree) are checkpointed, rolled back and forked.
//
// This file holds the root command, the global flags, the lazily opened engine and the
// mapping from errors to exit codes; each subcommand lives in a file of its own.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/memtune"
)

// app is the state shared by the commands of one invocation.
type app struct {
	dataDir   string
	poolDir   string
	poolImage string
	imagePool string
	json      bool
	jsonHint  bool // --json is on the command line (even if parsing failed before it)

	// started is set once cobra has parsed flags and arguments: errors before it are
	// usage errors (exit 2).
	started  bool
	eng      *engine.Engine
	progress *lazyProgress
	// standbyRestores is engine.Config.StandbyRestores for an in-process engine (bench).
	standbyRestores int

	url string         // --url: the daemon to use ("" to detect one)
	be  client.Backend // the backend in use, once chosen
}

// backend returns what the commands talk to: cairnd when --url (or $CAIRN_URL) names
// it, or when a daemon on the default socket serves the same data directory; the
// engine in process otherwise. One code path either way: the commands only see a
// client.Backend.
func (a *app) backend(ctx context.Context) (client.Backend, error) {
	if a.be != nil {
		return a.be, nil
	}
	if a.url != "" {
		a.be = client.New(a.url, "")
		return a.be, nil
	}
	sock := envOr("CAIRND_SOCKET", client.DefaultSocket)
	if _, err := os.Stat(sock); err == nil {
		c := client.New("unix://"+sock, "")
		hctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		h, err := c.Health(hctx)
		cancel()
		if err == nil && sameDir(h.DataDir, a.dataDir) {
			a.be = c
			return c, nil
		}
	}
	e, err := a.engine(ctx)
	if err != nil {
		return nil, err
	}
	a.be = local{e}
	return a.be, nil
}

func sameDir(a, b string) bool {
	ra, err1 := filepath.EvalSymlinks(a)
	rb, err2 := filepath.EvalSymlinks(b)
	return err1 == nil && err2 == nil && ra == rb
}

// engine opens the engine on first use.
func (a *app) engine(ctx context.Context) (*engine.Engine, error) {
	if a.eng != nil {
		return a.eng, nil
	}
	cfg := engine.Config{DataDir: a.dataDir, PoolDir: a.poolDir, PoolImage: a.poolImage, ImagePool: a.imagePool, StandbyRestores: a.standbyRestores,
		// Problems of background work (durable copies, standbys, compaction) of this
		// in-process engine; cairnd logs them.
		Logf: func(format string, args ...any) { fmt.Fprintf(os.Stderr, "cairn: background: "+format+"\n", args...) }}
	if !a.json {
		a.progress = &lazyProgress{w: os.Stderr}
		cfg.Progress = a.progress
	}
	e, err := engine.Open(ctx, cfg)
	if err != nil {
		return nil, err
	}
	a.eng = e
	return e, nil
}

// close finishes the progress display and closes the engine.
func (a *app) close(ok bool) {
	if a.progress != nil {
		a.progress.close(ok)
	}
	if a.eng != nil {
		a.eng.Close()
	}
}

const rootLong = `cairn runs sandboxes — a filesystem plus a process tree — that can be
checkpointed, rolled back and forked, files and running processes alike.

A typical session:

  id=$(cairn create)                       # new sandbox from template "debian"
  p=$(cairn exec -d $id -- python3 -i -u)  # start a long-lived process
  cairn stdin $id $p 'x = 41'              # talk to it
  c=$(cairn checkpoint $id --label before) # joint checkpoint: files + processes
  cairn rollback $id $c                    # back to it, processes included
  cairn fork $c --count 3                  # three independent copies

Commands that create something print its ID as the last line of standard output, so
scripts can capture it with $(...). Every command accepts --json and then prints one
JSON document on standard output (on failure: {"error":{"code":...,"message":...}}).

cairn needs root (namespaces, cgroups, CRIU, btrfs). State lives in --data-dir. When
cairnd runs (on /run/cairn/cairnd.sock, serving the same data directory) or --url names
a daemon, every command goes through its API instead, with the same output.

Exit codes:
  0  success
  1  internal error
  2  invalid argument or usage error
  3  not found
  4  already exists / conflict
  5  failed precondition (e.g. the sandbox is stopped)
  6  unavailable (or interrupted)
  7  resource exhausted
  8  permission denied
` + "`cairn exec`" + ` in the foreground exits with the command's own exit code instead.`

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// newRootCmd builds the command tree.
func newRootCmd(a *app) *cobra.Command {
	root := &cobra.Command{
		Use:           "cairn",
		Short:         "Sandboxes you can checkpoint, roll back and fork",
		Long:          rootLong,
		Example:       "  cairn create\n  cairn exec ID -- python3 -c 'print(1)'\n  cairn ls --json",
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			a.started = true
			return nil
		},
	}
	root.CompletionOptions.HiddenDefaultCmd = true
	pf := root.PersistentFlags()
	pf.StringVar(&a.dataDir, "data-dir", envOr("CAIRN_DATA_DIR", engine.DefaultDataDir), "state directory (env CAIRN_DATA_DIR)")
	pf.BoolVar(&a.json, "json", false, "print one machine-readable JSON document on stdout")
	pf.StringVar(&a.url, "url", os.Getenv("CAIRN_URL"), "cairnd to talk to: unix:///path.sock or http://host:port with $CAIRN_TOKEN (default: the local cairnd if it serves --data-dir, else in process; env CAIRN_URL)")
	pf.StringVar(&a.poolDir, "pool-dir", os.Getenv("CAIRN_POOL_DIR"), "advanced: btrfs pool mount point (default DATA_DIR/pool; env CAIRN_POOL_DIR)")
	pf.StringVar(&a.poolImage, "pool-image", os.Getenv("CAIRN_POOL_IMAGE"), `advanced: pool image file, "none" to use --pool-dir as is (default DATA_DIR/pool.img; env CAIRN_POOL_IMAGE)`)
	pf.StringVar(&a.imagePool, "image-pool", os.Getenv("CAIRN_IMAGE_POOL"), `advanced: image file of the btrfs filesystem that holds process images, "none" to keep them on the data directory's filesystem in incremental chains (default DATA_DIR/imgs.img; env CAIRN_IMAGE_POOL)`)
	root.AddCommand(
		newCreateCmd(a), newExecCmd(a), newStdinCmd(a), newCheckpointCmd(a), newRollbackCmd(a),
		newForkCmd(a), newPrewarmCmd(a), newTreeCmd(a), newRmCmd(a), newLsCmd(a), newInspectCmd(a), newDiffCmd(a),
		newTemplateCmd(a), newPsCmd(a), newLogsCmd(a), newKillCmd(a), newFilesCmd(a),
		newResumeCmd(a), newStopCmd(a), newGCCmd(a), newCkptCmd(a), newBenchCmd(a),
	)
	return root
}

// exitError makes cairn exit with a given code without printing anything (exec passes
// its command's exit code through this way).
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// exitCode maps an error to cairn's exit code.
func exitCode(err error, usage bool) int {
	var ee *exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	case usage:
		return 2
	}
	return errdefs.ExitCode(err)
}

// report prints err to stderr (and as JSON on stdout with --json) and returns the exit
// code. cmd is the command that ran (or failed to parse).
func report(a *app, cmd *cobra.Command, err error) int {
	usage := !a.started
	code := exitCode(err, usage)
	var ee *exitError
	if err == nil || errors.As(err, &ee) {
		return code
	}
	fmt.Fprintf(os.Stderr, "cairn: %v\n", err)
	if usage && cmd != nil {
		fmt.Fprintf(os.Stderr, "Usage: %s\nRun '%s --help' for more.\n", cmd.UseLine(), cmd.CommandPath())
	}
	if a.json || a.jsonHint {
		cls := errdefs.Code(err)
		if usage {
			cls = "invalid_argument"
		}
		printJSON(os.Stdout, map[string]any{"error": map[string]any{
			"code": cls, "exit_code": code, "message": err.Error(),
		}})
	}
	return code
}

// wantsJSON spots --json before flag parsing, so that even a usage error is reported
// as JSON.
func wantsJSON(args []string) bool {
	for _, s := range args {
		switch s {
		case "--":
			return false
		case "--json", "--json=true":
			return true
		}
	}
	return false
}

func main() {
	memtune.Apply()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	a := &app{jsonHint: wantsJSON(os.Args[1:])}
	cmd, err := newRootCmd(a).ExecuteContextC(ctx)
	a.close(err == nil)
	stop()
	os.Exit(report(a, cmd, err))
}
