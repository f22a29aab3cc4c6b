package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// The runc_criu and runsc baselines run W1's REPL state in plain OCI containers, each
// on a writable btrfs snapshot of the template, and checkpoint them by the obvious
// composition of existing tools: a read-only snapshot of the rootfs plus the runtime's
// own checkpoint (leave running). What differs between the two is the runtime CLI
// (ociRuntime); the measurements are the same code.

// ociRuntime is the OCI runtime CLI a baseline drives.
type ociRuntime interface {
	// start runs container k from its bundle, or restores it from images when images
	// is not "", with stdin and stdout (also its stderr) as its stdio. It returns once
	// the container runs.
	start(ctx context.Context, k *ociContainer, images string, stdin, stdout *os.File) error
	// checkpoint writes k's image into images, leaving k running, and calls snapshot
	// (the rootfs snapshot) where the runtime needs it: before the image or after.
	checkpoint(ctx context.Context, k *ociContainer, images string, snapshot func() error) error
	// kill ends container k. When it returns no process of k runs and k's rootfs can
	// be deleted; cleanup that can wait may continue in the background.
	kill(ctx context.Context, k *ociContainer) error
	// close waits for the runtime's background cleanup.
	close()
}

// ociContainer is one container of a baseline: a run or a restore, on its own volume
// and with its own ID (and cgroup).
type ociContainer struct {
	id     string
	bundle string   // bundle directory (config.json, pid file, restore logs)
	vol    string   // rootfs volume
	in     *os.File // write end of its stdin
	repl   *repl
}

// ociCheckpoint is one baseline checkpoint.
type ociCheckpoint struct {
	vol    string // read-only snapshot of the rootfs
	images string // the runtime's image directory (in the pool)
	want   replState
}

// ociBox runs W1's REPL in containers of one runtime.
type ociBox struct {
	s      *scratch
	rt     ociRuntime
	prefix string       // of container IDs
	n      atomic.Int64 // names handed out
	cur    *ociContainer
}

// name returns a fresh name: prefix and a fixed-width number. Fixed width matters to
// runsc, which resolves an ID given on its command line as a prefix.
func (c *ociBox) name(prefix string) string { return fmt.Sprintf("%s%04d", prefix, c.n.Add(1)) }

// ociConfig is a minimal runtime-spec config: python3 -i -u without a terminal, in new
// pid/mount/ipc/uts/network namespaces, with /proc, a tmpfs /dev and a devpts, in
// cgroup /cairn-bench/<id>.
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

// removeCgroupParents removes the (empty) parent cgroups the runtimes made for the
// baselines' containers; one still in use by a concurrent run stays.
func removeCgroupParents() {
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/cairn-bench")
	dirs = append(dirs, "/sys/fs/cgroup/cairn-bench")
	for _, d := range dirs {
		os.Remove(d)
	}
}

// launch makes a container on volume vol, run or (images not "") restored, with fresh
// pipes as its stdio and a REPL driver on them.
func (c *ociBox) launch(ctx context.Context, vol, images string) (*ociContainer, error) {
	k := &ociContainer{id: c.name(c.prefix), bundle: c.s.path(c.name("bundle")), vol: vol}
	cfg, err := ociConfig(c.s.pool.Path(vol), k.id)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(k.bundle, 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(k.bundle, "config.json"), cfg, 0o600); err != nil {
		return nil, err
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	err = c.rt.start(ctx, k, images, inR, outW)
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return nil, err
	}
	k.in = inW
	k.repl = &repl{t: newPipeTransport(inW, outR)}
	return k, nil
}

// remove kills k and deletes its rootfs.
func (c *ociBox) remove(ctx context.Context, k *ociContainer) error {
	err := c.rt.kill(ctx, k)
	k.in.Close()
	if err != nil {
		return err
	}
	return c.s.delete(ctx, k.vol)
}

// step edits 3 files of the current rootfs from the host and runs the REPL half of a
// W1 step.
func (c *ociBox) step(ctx context.Context, k int) error {
	for _, p := range c.stepFiles() {
		fh, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		fmt.Fprintf(fh, "step %d edit\n", k)
		if err := fh.Close(); err != nil {
			return err
		}
	}
	return c.cur.repl.step(ctx, k)
}

func (c *ociBox) stepFiles() []string {
	var out []string
	for f := 0; f < 3; f++ {
		out = append(out, filepath.Join(c.s.pool.Path(c.cur.vol), "workspace", fmt.Sprintf("f%d.txt", f)))
	}
	return out
}

// stepChangedBytes estimates what a step changes the way cairn's W1 does: the edited
// files (rewritten whole by the append), the 1 MiB str on the heap and the 10 rows.
func (c *ociBox) stepChangedBytes() (int64, error) {
	var n int64 = heapBytes + 10*rowBytes
	for _, p := range c.stepFiles() {
		fi, err := os.Stat(p)
		if err != nil {
			return 0, err
		}
		n += fi.Size()
	}
	return n, nil
}

// checkpoint takes a checkpoint of the current container.
func (c *ociBox) checkpoint(ctx context.Context) (ociCheckpoint, error) {
	ck := ociCheckpoint{images: c.s.path(c.name("images"))}
	if err := os.MkdirAll(ck.images, 0o700); err != nil {
		return ck, err
	}
	err := c.rt.checkpoint(ctx, c.cur, ck.images, func() error {
		var err error
		ck.vol, err = c.s.snapshot(ctx, c.cur.vol, c.name("ck"), true)
		return err
	})
	return ck, err
}

// measureCheckpoints runs n steps, each followed by a timed checkpoint whose on-disk
// cost is measured as measureSteps measures cairn's: the pool's used-bytes delta
// around it (syncfs, then statfs; outside the timing). The baseline's images are
// written into the pool, so the delta holds the rootfs snapshot and the image files
// together: the quantity cairn's pool delta + ImageBytes adds up to.
func (c *ociBox) measureCheckpoints(ctx context.Context, n int, br *BaselineReport) ([]ociCheckpoint, error) {
	var cks []ociCheckpoint
	var samples, storage, images []float64
	for k := 1; k <= n; k++ {
		if err := c.step(ctx, k); err != nil {
			return nil, err
		}
		st, err := c.cur.repl.probe(ctx)
		if err != nil {
			return nil, err
		}
		before, err := poolUsed(c.s.root)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		ck, err := c.checkpoint(ctx)
		if err != nil {
			return nil, err
		}
		samples = append(samples, ms(time.Since(start)))
		after, err := poolUsed(c.s.root)
		if err != nil {
			return nil, err
		}
		storage = append(storage, float64(after-before))
		images = append(images, float64(engine.DirBytes(ck.images)))
		ck.want = st
		cks = append(cks, ck)
	}
	br.CheckpointMS = summarize(samples)
	changed, err := c.stepChangedBytes()
	if err != nil {
		return nil, err
	}
	br.setStorage(storage, images, changed)
	return cks, nil
}

// rollback replaces the current container by one restored from ck on a writable
// snapshot of its rootfs, and deletes the old rootfs.
func (c *ociBox) rollback(ctx context.Context, ck ociCheckpoint) error {
	old := c.cur
	c.cur = nil
	err := c.rt.kill(ctx, old)
	old.in.Close()
	if err != nil {
		return err
	}
	vol, err := c.s.snapshot(ctx, ck.vol, c.name("root"), false)
	if err != nil {
		return err
	}
	if c.cur, err = c.launch(ctx, vol, ck.images); err != nil {
		return err
	}
	return c.s.delete(ctx, old.vol)
}

func (c *ociBox) measureRollbacks(ctx context.Context, b *runner, cks []ociCheckpoint, n int, br *BaselineReport) error {
	var samples []float64
	for i := 0; i < n; i++ {
		ck := cks[b.rng.IntN(len(cks))]
		start := time.Now()
		if err := c.rollback(ctx, ck); err != nil {
			return err
		}
		samples = append(samples, ms(time.Since(start)))
		if err := c.cur.repl.verify(ctx, ck.want); err != nil {
			return fmt.Errorf("state after rollback: %w", err)
		}
		br.Checks++
	}
	br.RollbackMS = summarize(samples)
	return nil
}

// forkParallelism bounds concurrent restores of one fork, as cairn's Engine.Fork does.
const forkParallelism = 4

// fork makes count containers restored from ck, each on its own writable snapshot of
// its rootfs, and returns once all of them run. On failure none is left.
func (c *ociBox) fork(ctx context.Context, ck ociCheckpoint, count int) ([]*ociContainer, error) {
	out := make([]*ociContainer, count)
	errs := make([]error, count)
	sem := make(chan struct{}, forkParallelism)
	var wg sync.WaitGroup
	for i := range out {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			vol, err := c.s.snapshot(ctx, ck.vol, c.name("fork"), false)
			if err == nil {
				out[i], err = c.launch(ctx, vol, ck.images)
			}
			errs[i] = err
		}(i)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		c.removeAll(context.WithoutCancel(ctx), out)
		return nil, err
	}
	return out, nil
}

// removeAll removes the containers of a fork (nil entries skipped).
func (c *ociBox) removeAll(ctx context.Context, ks []*ociContainer) error {
	var errs []error
	for _, k := range ks {
		if k != nil {
			errs = append(errs, c.remove(ctx, k))
		}
	}
	return errors.Join(errs...)
}

// measureForks forks ck 16 at a time, reps times, timed until all 16 run; then checks
// every fork's REPL state and removes them (untimed).
func (c *ociBox) measureForks(ctx context.Context, ck ociCheckpoint, reps int, br *BaselineReport) error {
	var samples []float64
	for i := 0; i < reps; i++ {
		start := time.Now()
		ks, err := c.fork(ctx, ck, 16)
		if err != nil {
			return fmt.Errorf("fork ×16: %w", err)
		}
		samples = append(samples, ms(time.Since(start)))
		for j, k := range ks {
			if err = k.repl.verify(ctx, ck.want); err != nil {
				err = fmt.Errorf("state of fork %d/%d: %w", i, j, err)
				break
			}
			br.Checks++
		}
		if rerr := c.removeAll(ctx, ks); err == nil {
			err = rerr
		}
		if err != nil {
			return err
		}
	}
	br.Fork16MS = summarize(samples)
	return nil
}

// ociBaseline measures, with runtime rt, n checkpoints (each after a step), n
// rollbacks to a random one of them, and fork ×16 from the last, max(2, n/10) times,
// of a container holding W1's REPL state.
func (b *runner) ociBaseline(ctx context.Context, s *scratch, rt ociRuntime, n int, br *BaselineReport) (err error) {
	defer func() {
		rt.close()
		removeCgroupParents()
	}()
	tvol, err := b.templateVolume(ctx)
	if err != nil {
		return err
	}
	c := &ociBox{s: s, rt: rt, prefix: "cb-" + s.rel[len(s.rel)-6:] + "-"}
	vol, err := s.snapshot(ctx, tvol, c.name("root"), false)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(s.pool.Path(vol), "workspace"), 0o755); err != nil {
		return err
	}
	if c.cur, err = c.launch(ctx, vol, ""); err != nil {
		return err
	}
	defer func() {
		if c.cur != nil {
			if rerr := c.remove(context.WithoutCancel(ctx), c.cur); err == nil {
				err = rerr
			}
		}
	}()
	if err := c.cur.repl.setupW1(ctx, dbPath); err != nil {
		return err
	}
	settleDeletions(ctx, c.s.root)
	cks, err := c.measureCheckpoints(ctx, n, br)
	if err != nil {
		return err
	}
	if err := c.measureRollbacks(ctx, b, cks, n, br); err != nil {
		return err
	}
	return c.measureForks(ctx, cks[len(cks)-1], max(2, n/10), br)
}

// templateVolume returns the pool volume of template "debian".
func (b *runner) templateVolume(ctx context.Context) (string, error) {
	tmpls, err := b.e.Templates(ctx)
	if err != nil {
		return "", err
	}
	for _, t := range tmpls {
		if t.Name == "debian" {
			return t.Volume, nil
		}
	}
	return "", errdefs.NotFound("template debian not found: build it with `cairn template build debian`")
}
