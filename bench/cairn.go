package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/phase"
)

// maxAncestors is how far back a rollback target may lie (W1: the last 20 checkpoints).
const maxAncestors = 20

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// poolUsed returns the bytes in use on the pool's filesystem after syncfs, which
// commits btrfs's transaction so that the figure includes what was just written.
func poolUsed(root string) (int64, error) {
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return 0, err
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return 0, err
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, nil
}

// settleDeletions waits, at most settleWait, until btrfs has freed the space of the
// volumes deleted on root's filesystem so far (`btrfs subvolume sync`). A deleted
// volume's extents are freed later, by the kernel's cleaner: the deletions that end one
// measurement (cairn's clean-up, a baseline's rollbacks) would otherwise shrink the
// next one's used-bytes deltas, down to below zero (a runsc baseline once read -311
// MiB a checkpoint). Off the clock, before a baseline's first step.
func settleDeletions(ctx context.Context, root string) {
	ctx, cancel := context.WithTimeout(ctx, settleWait)
	defer cancel()
	exec.CommandContext(ctx, "btrfs", "subvolume", "sync", root).Run() // best effort
}

// settle waits, before a workload's sandbox is set up, for the volumes deleted earlier
// on the pool (by an earlier run or workload), and says so: btrfs's cleaner drops them
// for seconds (182 after a W1 run: 8 s), and its transactions slowed the snapshots of a
// run that started at once (checkpoint snapshot p50 15-23 ms against 8.5 after a
// settled pool, docs/performance.md).
func (b *runner) settle(ctx context.Context) {
	root := b.e.PoolPath("")
	out, err := exec.CommandContext(ctx, "btrfs", "subvolume", "list", "-d", root).Output()
	if n := strings.Count(string(out), "\n"); err == nil && n > 0 {
		b.phase("waiting until btrfs has dropped the %d volumes deleted earlier (off the clock, at most %s)", n, settleWait)
		settleDeletions(ctx, root)
	}
}

// settleWait bounds settleDeletions: a deleted volume still in use is freed only once
// its last user goes. A W1 run with its baselines leaves ~20 s of deletions.
const settleWait = 60 * time.Second

// growth runs f and returns how many bytes the filesystem at root gained meanwhile.
func growth(root string, f func() error) (float64, error) {
	before, err := poolUsed(root)
	if err != nil {
		return 0, err
	}
	if err := f(); err != nil {
		return 0, err
	}
	after, err := poolUsed(root)
	return float64(after - before), err
}

// traced runs op, named what, with a phase recorder (internal/phase) and appends the
// time of each phase it reported to into, if into is not nil; and writes the phases to
// the run's timeline (Options.Timeline), if it has one.
func traced(ctx context.Context, what string, into map[string][]float64, op func(context.Context) error) error {
	if into == nil {
		return op(ctx)
	}
	var mu sync.Mutex
	sums := map[string]float64{}
	tl, _ := ctx.Value(timelineKey{}).(*timeline)
	var lines []string
	start := time.Now()
	err := op(phase.With(ctx, func(name string, d time.Duration) {
		end := time.Since(start)
		mu.Lock()
		sums[name] += ms(d)
		if tl != nil {
			lines = append(lines, fmt.Sprintf("  %7.2f %7.2f  %s", ms(end-d), ms(d), name))
		}
		mu.Unlock()
	}))
	total := time.Since(start)
	mu.Lock()
	defer mu.Unlock()
	for name, v := range sums {
		into[name] = append(into[name], v)
	}
	if tl != nil {
		tl.write(fmt.Sprintf("%s: %.2f ms (phase: began after, took, ms)", what, ms(total)), lines)
	}
	return err
}

// timeline is Options.Timeline, carried by the run's context.
type timeline struct {
	mu sync.Mutex
	w  io.Writer
}

type timelineKey struct{}

// write writes the head line and the lines of one operation, sorted by when they
// began.
func (t *timeline) write(head string, lines []string) {
	sort.Strings(lines) // fixed-width start times: sorted by start
	t.mu.Lock()
	defer t.mu.Unlock()
	fmt.Fprintln(t.w, head)
	for _, l := range lines {
		fmt.Fprintln(t.w, l)
	}
}

// checkpoint records the expected state, then takes (and times) a checkpoint.
func (w *w1) checkpoint(ctx context.Context) (*model.Checkpoint, time.Duration, error) {
	want, err := w.record(ctx)
	if err != nil {
		return nil, 0, err
	}
	sb, err := w.e.Get(ctx, w.id)
	if err != nil {
		return nil, 0, err
	}
	var ck *model.Checkpoint
	start := time.Now()
	err = traced(ctx, "checkpoint", w.ckPhases, func(ctx context.Context) (err error) {
		ck, err = w.e.Checkpoint(ctx, w.id, engine.CheckpointOptions{})
		return err
	})
	d := time.Since(start)
	if err != nil {
		return nil, d, fmt.Errorf("checkpoint: %w", err)
	}
	w.expect[ck.ID] = want
	w.parent[ck.ID] = sb.Head
	return ck, d, nil
}

// measureSteps takes the base checkpoint (of W1's state before any step; its time
// and bytes are reported apart), then runs n steps, each followed by a timed
// checkpoint whose on-disk cost is measured as the pool's used-bytes delta from before
// its step to after it. The syncfs that measures "before" runs before the step, not
// between the step and the checkpoint: the step's writes are still unflushed when the
// checkpoint starts, as they are when an agent checkpoints, and flushing them is part of
// the checkpoint's snapshot.
func (b *runner) measureSteps(ctx context.Context, n int) error {
	root := b.e.PoolPath("")
	var base *model.Checkpoint
	grew, err := growth(root, func() (err error) {
		base, _, err = b.w.checkpoint(ctx)
		return err
	})
	if err != nil {
		return err
	}
	b.baseCk, b.baseFS = base.ID, grew
	// The base's images, written in the background, are not the steps': the image
	// pool's usage is taken once they are (untimed).
	if img := b.e.ImagePoolPath(); img != "" {
		b.e.Quiesce()
		if b.imgUsed0, err = poolUsed(img); err != nil {
			return err
		}
	}
	var dumped []float64
	for i := 0; i < n; i++ {
		var ck *model.Checkpoint
		var d time.Duration
		grew, err := growth(root, func() (err error) {
			if err := b.w.step(ctx); err != nil {
				return err
			}
			ck, d, err = b.w.checkpoint(ctx)
			return err
		})
		if err != nil {
			return err
		}
		b.addCheckpoint(ck, d)
		// The filesystem half shares extents in the pool; the images are files outside
		// it (the data directory's, or the image pool's).
		b.stepCks = append(b.stepCks, ck.ID)
		b.stepFS = append(b.stepFS, grew)
		dumped = append(dumped, float64(ck.ImageBytes))
	}
	b.rep.DumpedImageBytesPerCheckpoint = summarize(dumped)
	changed, err := b.w.stepChangedBytes(ctx)
	if err != nil {
		return err
	}
	b.rep.StepChangedBytes = changed
	return nil
}

// finishStorage measures the storage of the steps' checkpoints once the background work
// (compaction of their images against their parents') is done: pool bytes each added
// plus its images' bytes now on disk.
func (b *runner) finishStorage(ctx context.Context) error {
	var storage, images []float64
	for i, id := range b.stepCks {
		ck, err := b.e.GetCheckpoint(ctx, id)
		if err != nil {
			return err
		}
		storage = append(storage, b.stepFS[i]+float64(ck.ImageBytes))
		images = append(images, float64(ck.ImageBytes))
	}
	b.rep.StorageBytesPerCheckpoint = summarize(storage)
	b.rep.ImageBytesPerCheckpoint = summarize(images)
	mean := b.rep.StorageBytesPerCheckpoint.Mean
	if img := b.e.ImagePoolPath(); img != "" && b.imgUsed0 > 0 {
		// What every checkpoint since the base added to the image pool, once shared and
		// compressed (the rows count the images' own pages uncompressed).
		used, err := poolUsed(img)
		if err != nil {
			return err
		}
		b.rep.ImageDiskBytesPerCheckpoint = float64(used-b.imgUsed0) / float64(len(b.ckMS))
		mean = summarize(b.stepFS).Mean + b.rep.ImageDiskBytesPerCheckpoint
	}
	if b.baseCk != "" {
		ck, err := b.e.GetCheckpoint(ctx, b.baseCk)
		if err != nil {
			return err
		}
		b.rep.BaseCheckpointBytes = int64(b.baseFS) + ck.ImageBytes
	}
	if b.rep.StepChangedBytes > 0 {
		b.rep.StorageRatio = mean / float64(b.rep.StepChangedBytes)
	}
	return nil
}

// residents records the W1 sandbox's resident checkpoints and the memory their zygotes
// hold beyond its processes'.
func (b *runner) residents(ctx context.Context) error {
	sb, err := b.e.Inspect(ctx, b.w.id)
	if err != nil {
		return err
	}
	b.rep.ResidentMemoryBytes, b.rep.ResidentsHeld = sb.ResidentMemoryBytes, sb.ResidentCheckpoints
	return nil
}

// stepChangedBytes estimates the bytes the last step changed: the 3 edited files
// (rewritten whole by the append), git's index (rewritten whole by `git add`), the
// 1 MiB str added to the heap and the payload of the 10 rows.
func (w *w1) stepChangedBytes(ctx context.Context) (int64, error) {
	var n int64 = heapBytes + 10*rowBytes
	names := []string{path.Join(repoDir, ".git/index")}
	for k := 0; k < 3; k++ {
		names = append(names, path.Join(repoDir, fmt.Sprintf("f%03d.txt", (w.steps*7919+k*331)%1000)))
	}
	for _, p := range names {
		fi, err := w.e.Stat(ctx, w.id, p)
		if err != nil {
			return 0, err
		}
		n += fi.Size
	}
	return n, nil
}

// ancestors returns the head and its ancestors, newest first, at most maxAncestors.
func (w *w1) ancestors(ctx context.Context) ([]string, error) {
	sb, err := w.e.Get(ctx, w.id)
	if err != nil {
		return nil, err
	}
	var out []string
	for c := sb.Head; c != "" && len(out) < maxAncestors; c = w.parent[c] {
		out = append(out, c)
	}
	return out, nil
}

// measureRollbacks rolls back n times to a random ancestor among the last 20
// checkpoints, checks the state, then runs a step and checkpoints (so the checkpoints
// form a tree, as in a search).
func (b *runner) measureRollbacks(ctx context.Context, n int) error {
	for i := 0; i < n; i++ {
		anc, err := b.w.ancestors(ctx)
		if err != nil {
			return err
		}
		target := anc[b.rng.IntN(len(anc))]
		start := time.Now()
		if err := traced(ctx, "rollback to "+target, b.rbPhases, func(ctx context.Context) error { return b.e.Rollback(ctx, b.w.id, target) }); err != nil {
			return fmt.Errorf("rollback to %s: %w", target, err)
		}
		b.rbMS = append(b.rbMS, ms(time.Since(start)))
		b.rep.Correctness.add(fmt.Sprintf("rollback %d to %s", i, target), b.w.check(ctx, b.w.id, b.w.repl, b.w.expect[target]))
		if err := b.w.step(ctx); err != nil {
			return err
		}
		ck, d, err := b.w.checkpoint(ctx)
		if err != nil {
			return err
		}
		b.addCheckpoint(ck, d)
	}
	return nil
}

// measureForks forks the head checkpoint count at a time, reps times, checking and
// removing every fork.
func (b *runner) measureForks(ctx context.Context, count, reps int) (Stats, error) {
	anc, err := b.w.ancestors(ctx)
	if err != nil {
		return Stats{}, err
	}
	ck := anc[0]
	var samples []float64
	for i := 0; i < reps; i++ {
		start := time.Now()
		forks, err := b.e.Fork(ctx, ck, count)
		if err != nil {
			return Stats{}, fmt.Errorf("fork ×%d of %s: %w", count, ck, err)
		}
		samples = append(samples, ms(time.Since(start)))
		for j, f := range forks {
			b.rep.Correctness.add(fmt.Sprintf("fork ×%d #%d/%d of %s", count, i, j, ck), b.w.check(ctx, f.ID, nil, b.w.expect[ck]))
		}
		for _, f := range forks {
			if err := b.e.Remove(ctx, f.ID); err != nil {
				return Stats{}, fmt.Errorf("remove fork %s: %w", f.ID, err)
			}
		}
	}
	return summarize(samples), nil
}

// measureWarmForks prewarms 16 standbys of the head checkpoint (timed as background
// work), then times fork ×16, reps times, checking and removing every fork.
func (b *runner) measureWarmForks(ctx context.Context, reps int) error {
	anc, err := b.w.ancestors(ctx)
	if err != nil {
		return err
	}
	ck := anc[0]
	var samples, prewarm []float64
	for i := 0; i < reps; i++ {
		t := time.Now()
		if err := b.e.Prewarm(ctx, ck, 16); errors.Is(err, errdefs.ErrFailedPrecondition) {
			b.phase("no warm forks: %v", err) // a backend without standbys (gvisor)
			return nil
		} else if err != nil {
			return fmt.Errorf("prewarm: %w", err)
		}
		prewarm = append(prewarm, time.Since(t).Seconds())
		start := time.Now()
		forks, err := b.e.Fork(ctx, ck, 16)
		if err != nil {
			return fmt.Errorf("fork ×16 of %s: %w", ck, err)
		}
		samples = append(samples, ms(time.Since(start)))
		for j, f := range forks {
			b.rep.Correctness.add(fmt.Sprintf("warm fork ×16 #%d/%d of %s", i, j, ck), b.w.check(ctx, f.ID, nil, b.w.expect[ck]))
		}
		for _, f := range forks {
			if err := b.e.Remove(ctx, f.ID); err != nil {
				return fmt.Errorf("remove fork %s: %w", f.ID, err)
			}
		}
		b.e.Quiesce() // let the replacements of the taken standbys finish
	}
	b.rep.Fork16WarmMS = summarize(samples)
	b.rep.Prewarm16S = summarize(prewarm).Mean
	return nil
}

// measureCreate times Create from the template until a trivial exec works, n times.
func (b *runner) measureCreate(ctx context.Context, n int) error {
	var samples []float64
	for i := 0; i < n; i++ {
		start := time.Now()
		sb, err := b.e.Create(ctx, model.CreateOptions{Template: "debian", Isolation: b.iso})
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
		_, err = run(ctx, b.e, sb.ID, "true")
		samples = append(samples, ms(time.Since(start)))
		if rerr := b.e.Remove(ctx, sb.ID); err == nil {
			err = rerr
		}
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
	}
	b.rep.CreateMS = summarize(samples)
	return nil
}

// overheadRSS reads the VmRSS of the sandbox's init (cairn-init), the only process the
// sandbox runs beyond its own.
func (b *runner) overheadRSS(ctx context.Context) (int64, error) {
	sb, err := b.e.Get(ctx, b.w.id)
	if err != nil {
		return 0, err
	}
	return vmRSS(sb.Init.Pid)
}

func vmRSS(pid int) (int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	var kb int64
	for _, l := range strings.Split(string(data), "\n") {
		if _, err := fmt.Sscanf(l, "VmRSS: %d kB", &kb); err == nil {
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

// addCheckpoint counts a measured checkpoint that took d.
func (b *runner) addCheckpoint(ck *model.Checkpoint, d time.Duration) {
	b.ckMS = append(b.ckMS, ms(d))
	if v, ok := ck.PhasesMS["stopped"]; ok {
		b.stoppedMS = append(b.stoppedMS, v)
	}
}
