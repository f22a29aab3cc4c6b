package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/cairn-sandbox/cairn/criu"
)

// runcBox is a runc container running W1's REPL on a writable btrfs snapshot of the
// template, checkpointed by the obvious composition of existing tools: a read-only
// snapshot of its rootfs plus `runc checkpoint --leave-running`.
type runcBox struct {
	s     *scratch
	state string // runc --root
	criu  string
	id    string
	vol   string // current rootfs volume
	n     int    // volumes made so far
	in    *os.File
	repl  *repl
}

// runcCheckpoint is one baseline checkpoint.
type runcCheckpoint struct {
	vol, images string
	want        expected
}

// ociConfig is a minimal runtime-spec config: python3 -i -u without a terminal, in new
// pid/mount/ipc/uts/network namespaces, with /proc, a tmpfs /dev and a devpts.
func ociConfig(rootfs, id string) ([]byte, error) {
	mount := func(dst, typ string, opts ...string) map[string]any {
		return map[string]any{"destination": dst, "type": typ, "source": typ, "options": opts}
	}
	ns := []map[string]string{}
	for _, t := range []string{"pid", "mount", "ipc", "uts", "network"} {
		ns = append(ns, map[string]string{"type": t})
	}
	return json.MarshalIndent(map[string]any{
		"ociVersion": "1.0.2",
		"process": map[string]any{
			"terminal": false, "user": map[string]int{"uid": 0, "gid": 0},
			"args": []string{"python3", "-i", "-u"}, "cwd": "/workspace",
			"env": []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8"},
		},
		"root":     map[string]any{"path": rootfs, "readonly": false},
		"hostname": id,
		"mounts": []map[string]any{
			mount("/proc", "proc"),
			mount("/dev", "tmpfs", "nosuid", "strictatime", "mode=755", "size=65536k"),
			mount("/dev/pts", "devpts", "nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"),
			mount("/dev/shm", "tmpfs", "nosuid", "noexec", "nodev", "mode=1777", "size=65536k"),
		},
		"linux": map[string]any{"namespaces": ns, "cgroupsPath": "/cairn-bench/" + id},
	}, "", "  ")
}

// runc runs one runc command. stdin and stdout (nil: none) become the stdio of a
// container it starts, stdout also its stderr; runc's own diagnostics go to a log file
// (stdio of a container must be pipes: CRIU cannot dump a file outside its mounts).
func (c *runcBox) runc(ctx context.Context, stdin, stdout *os.File, args ...string) error {
	logf, err := os.CreateTemp("", "bench-runc-")
	if err != nil {
		return err
	}
	defer os.Remove(logf.Name())
	defer logf.Close()
	cmd := exec.CommandContext(ctx, runcPath, append([]string{"--root", c.state, "--criu", c.criu, "--log", logf.Name()}, args...)...)
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

// bundle writes a bundle whose rootfs is volume vol and returns its directory.
func (c *runcBox) bundle(vol string) (string, error) {
	cfg, err := ociConfig(c.s.pool.Path(vol), c.id)
	if err != nil {
		return "", err
	}
	dir := c.s.path(fmt.Sprintf("bundle%d", c.n))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	return dir, os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o600)
}

// launch runs `runc run -d` (or `runc restore -d` with restoreArgs) on volume vol, with
// fresh pipes as the container's stdio, and points the REPL driver at them.
func (c *runcBox) launch(ctx context.Context, vol string, restoreArgs ...string) error {
	bundle, err := c.bundle(vol)
	if err != nil {
		return err
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return err
	}
	args := []string{"run", "-d", "--bundle", bundle, c.id}
	if len(restoreArgs) > 0 {
		args = append(append([]string{"restore", "-d", "--bundle", bundle}, restoreArgs...), c.id)
	}
	err = c.runc(ctx, inR, outW, args...)
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return err
	}
	if c.in != nil {
		c.in.Close()
	}
	c.in, c.vol = inW, vol
	if c.repl == nil {
		c.repl = &repl{}
	}
	c.repl.t, c.repl.off = newPipeTransport(inW, outR), 0
	return nil
}

// removeCgroupParents removes the (empty) parent cgroups runc made for the baseline's
// containers; one still in use by a concurrent run stays.
func removeCgroupParents() {
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/cairn-bench")
	for _, d := range dirs {
		os.Remove(d)
	}
}

// runcBaseline measures n checkpoints (each after a step) and n rollbacks of a runc
// container holding W1's REPL state.
func (b *runner) runcBaseline(ctx context.Context, s *scratch, n int, br *BaselineReport) error {
	br.Method = "btrfs read-only snapshot of the rootfs + `runc checkpoint --leave-running`; rollback: `runc delete -f` + writable snapshot + `runc restore -d` (runc " + b.rep.Machine.Runc + ")"
	tmpls, err := b.e.Templates(ctx)
	if err != nil {
		return err
	}
	tvol := ""
	for _, t := range tmpls {
		if t.Name == "debian" {
			tvol = t.Volume
		}
	}
	c := &runcBox{s: s, state: s.path("state"), id: "cairnbench" + s.rel[len(s.rel)-6:]}
	if c.criu, err = criu.Find(); err != nil {
		return err
	}
	vol, err := s.snapshot(ctx, tvol, "root0", false)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(s.pool.Path(vol), "workspace"), 0o755); err != nil {
		return err
	}
	if err := c.launch(ctx, vol); err != nil {
		return err
	}
	defer func() {
		c.runc(context.WithoutCancel(ctx), nil, nil, "delete", "-f", c.id)
		c.in.Close()
		removeCgroupParents()
	}()
	if err := c.repl.setupW1(ctx, dbPath); err != nil {
		return err
	}
	cks, err := c.measureCheckpoints(ctx, n, br)
	if err != nil {
		return err
	}
	return c.measureRollbacks(ctx, b, cks, n, br)
}

// step edits 3 files of the rootfs from the host and runs the REPL half of a W1 step.
func (c *runcBox) step(ctx context.Context, k int) error {
	for f := 0; f < 3; f++ {
		p := filepath.Join(c.s.pool.Path(c.vol), "workspace", fmt.Sprintf("f%d.txt", f))
		fh, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		fmt.Fprintf(fh, "step %d edit\n", k)
		if err := fh.Close(); err != nil {
			return err
		}
	}
	return c.repl.step(ctx, k)
}

// checkpoint snapshots the rootfs read-only, then dumps the container leaving it running.
func (c *runcBox) checkpoint(ctx context.Context) (runcCheckpoint, error) {
	c.n++
	ck := runcCheckpoint{images: c.s.path(fmt.Sprintf("images%d", c.n))}
	if err := os.MkdirAll(ck.images, 0o700); err != nil {
		return ck, err
	}
	var err error
	if ck.vol, err = c.s.snapshot(ctx, c.vol, fmt.Sprintf("ck%d", c.n), true); err != nil {
		return ck, err
	}
	return ck, c.runc(ctx, nil, nil, "checkpoint", "--leave-running", "--file-locks", "--tcp-established",
		"--image-path", ck.images, "--work-path", ck.images, c.id)
}

func (c *runcBox) measureCheckpoints(ctx context.Context, n int, br *BaselineReport) ([]runcCheckpoint, error) {
	var cks []runcCheckpoint
	var samples []float64
	for k := 1; k <= n; k++ {
		if err := c.step(ctx, k); err != nil {
			return nil, err
		}
		st, err := c.repl.probe(ctx)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		ck, err := c.checkpoint(ctx)
		if err != nil {
			return nil, err
		}
		samples = append(samples, ms(time.Since(start)))
		ck.want = expected{REPL: st}
		cks = append(cks, ck)
	}
	br.CheckpointMS = summarize(samples)
	return cks, nil
}

// rollback replaces the container by one restored from ck on a writable snapshot of
// its rootfs, and deletes the old rootfs.
func (c *runcBox) rollback(ctx context.Context, ck runcCheckpoint) error {
	if err := c.runc(ctx, nil, nil, "delete", "-f", c.id); err != nil {
		return err
	}
	c.n++
	vol, err := c.s.snapshot(ctx, ck.vol, fmt.Sprintf("root%d", c.n), false)
	if err != nil {
		return err
	}
	old, work := c.vol, c.s.path(fmt.Sprintf("restore%d", c.n))
	if err := os.MkdirAll(work, 0o700); err != nil {
		return err
	}
	if err := c.launch(ctx, vol, "--file-locks", "--tcp-established", "--image-path", ck.images, "--work-path", work); err != nil {
		return err
	}
	return c.s.pool.Delete(ctx, old)
}

func (c *runcBox) measureRollbacks(ctx context.Context, b *runner, cks []runcCheckpoint, n int, br *BaselineReport) error {
	var samples []float64
	for i := 0; i < n; i++ {
		ck := cks[b.rng.IntN(len(cks))]
		start := time.Now()
		if err := c.rollback(ctx, ck); err != nil {
			return err
		}
		samples = append(samples, ms(time.Since(start)))
		if err := c.repl.verify(ctx, ck.want.REPL); err != nil {
			return fmt.Errorf("state after rollback: %w", err)
		}
		br.Checks++
	}
	br.RollbackMS = summarize(samples)
	return nil
}
