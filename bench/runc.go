package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/cairn-sandbox/cairn/criu"
)

// runcRuntime drives runc, which checkpoints and restores with CRIU.
type runcRuntime struct {
	state string // runc --root
	criu  string
}

// runcBaseline is the runc_criu baseline: ociBaseline with runc.
func (b *runner) runcBaseline(ctx context.Context, s *scratch, n int, br *BaselineReport) error {
	br.Method = "runc " + b.rep.Machine.Runc + ": btrfs read-only snapshot of the rootfs + `runc checkpoint --leave-running` (CRIU); " +
		"rollback: `runc delete -f` + writable snapshot + `runc restore -d` + delete of the old rootfs; " +
		"fork ×16: 16 writable snapshots + `runc restore -d` (4 at a time, as cairn's fork), each its own container and cgroup"
	if _, err := os.Stat(runcPath); err != nil {
		return fmt.Errorf("runc is not installed at %s: install Debian's runc package", runcPath)
	}
	rt := &runcRuntime{state: s.path("state")}
	var err error
	if rt.criu, err = criu.Find(); err != nil {
		return err
	}
	return b.ociBaseline(ctx, s, rt, n, br)
}

// run runs one runc command. stdin and stdout (nil: none) become the stdio of a
// container it starts, stdout also its stderr; runc's own diagnostics go to a log file
// (stdio of a container must be pipes: CRIU cannot dump a file outside its mounts).
func (r *runcRuntime) run(ctx context.Context, stdin, stdout *os.File, args ...string) error {
	logf, err := os.CreateTemp("", "bench-runc-")
	if err != nil {
		return err
	}
	defer os.Remove(logf.Name())
	defer logf.Close()
	cmd := exec.CommandContext(ctx, runcPath, append([]string{"--root", r.state, "--criu", r.criu, "--log", logf.Name()}, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stdout
	if stdout == nil {
		cmd.Stdout, cmd.Stderr = logf, logf
	}
	if err := cmd.Run(); err != nil {
		msg, _ := os.ReadFile(logf.Name())
		return fmt.Errorf("runc %s: %v: %s%s", args[0], err, tail(msg, 600), criuLogErrors(string(msg)))
	}
	return nil
}

func (r *runcRuntime) start(ctx context.Context, k *ociContainer, images string, stdin, stdout *os.File) error {
	if images == "" {
		return r.run(ctx, stdin, stdout, "run", "-d", "--bundle", k.bundle, k.id)
	}
	return r.run(ctx, stdin, stdout, "restore", "-d", "--bundle", k.bundle, "--file-locks", "--tcp-established",
		"--image-path", images, "--work-path", k.bundle, k.id)
}

// checkpoint snapshots the rootfs read-only, then dumps the container leaving it
// running.
func (r *runcRuntime) checkpoint(ctx context.Context, k *ociContainer, images string, snapshot func() error) error {
	if err := snapshot(); err != nil {
		return err
	}
	return r.run(ctx, nil, nil, "checkpoint", "--leave-running", "--file-locks", "--tcp-established",
		"--image-path", images, "--work-path", images, k.id)
}

func (r *runcRuntime) kill(ctx context.Context, k *ociContainer) error {
	return r.run(ctx, nil, nil, "delete", "-f", k.id)
}

func (r *runcRuntime) close() {}

// criuLogErrors returns the error lines of the CRIU log a runc message names, if any.
func criuLogErrors(msg string) string {
	i := strings.Index(msg, "log file: ")
	if i < 0 {
		return ""
	}
	f := strings.FieldsFunc(msg[i+len("log file: "):], func(r rune) bool { return r == '"' || r == '\\' || r == '\n' })
	if len(f) == 0 {
		return ""
	}
	log, err := os.ReadFile(strings.TrimSpace(f[0]))
	if err != nil {
		return ""
	}
	var errs []string
	for _, l := range strings.Split(string(log), "\n") {
		if strings.Contains(l, "Error") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	return " (CRIU log: " + tail([]byte(strings.Join(errs, " | ")), 800) + ")"
}
