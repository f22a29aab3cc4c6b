// Package bench measures cairn on its reference workloads (see REFERENCE.md): for now
// W1, the coding-agent sandbox, with the runc_criu (runc + CRIU), runsc (gVisor) and
// copytree baselines measured in the same run on the same state.
//
// W1 builds a sandbox from template "debian" holding an idle bash, a Python REPL (a
// ~40 MB dict, a sqlite3 connection with an open transaction, a suspended generator)
// and a git repository of 1,000 files, then measures checkpoint after each step,
// rollback to a random ancestor, fork ×1/×4/×16, create, and the storage each
// checkpoint adds. Every rollback and fork is checked against the state recorded when
// its checkpoint was taken. The baselines report the same keys (checkpoint_ms,
// rollback_ms, fork16_ms, storage_ratio), measured the same way.
package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// Options configure Run.
type Options struct {
	Workload   string // "w1", "w2", "w3" or "all"
	Iterations int    // steps/checkpoints (default 20)
	Baselines  bool   // also run the runc_criu, runsc and copytree baselines
	// Isolation lists the backends to measure, side by side (default: container).
	Isolation []string
	Progress  io.Writer // one line per phase; nil for silence
	// StandbyRestores is recorded in the report: the engine's Config.StandbyRestores
	// (the caller opened the engine with it).
	StandbyRestores int
	// WarmMemory writes once to the guest's free memory before measuring, so that the
	// hypervisor's first-touch faults are not counted in the figures (memory.go).
	WarmMemory bool
	// Seed seeds the run's random choices (rollback targets, W2's rewards), so that two
	// runs, say of two builds, make the same ones; 0 picks one, which the report records.
	Seed uint64
	// Timeline, if not nil, gets a line per phase of every checkpoint and rollback
	// measured: when it began after the operation's start, and how long it took.
	Timeline io.Writer
}

// Report is the result of a run. Times are milliseconds, sizes bytes.
type Report struct {
	Workload   string    `json:"workload"`
	Iterations int       `json:"iterations"`
	StartedAt  time.Time `json:"started_at"`
	DurationS  float64   `json:"duration_s"`
	Machine    Machine   `json:"machine"`
	// StandbyRestores is how many standby restores the engine ran at once.
	StandbyRestores int `json:"standby_restores,omitempty"`
	// Seed seeded the run's random choices (--seed repeats them).
	Seed uint64 `json:"seed"`

	CheckpointMS Stats `json:"checkpoint_ms"`
	// CheckpointStoppedMS is how long a checkpoint kept the sandbox's processes from
	// running (stop to resume), of the checkpoints kept resident; the call lasts longer
	// (the snapshot's commit, the checkpoint's row).
	CheckpointStoppedMS Stats `json:"checkpoint_stopped_ms"`
	RollbackMS          Stats `json:"rollback_ms"`
	Fork1MS             Stats `json:"fork1_ms"`
	Fork4MS             Stats `json:"fork4_ms"`
	Fork16MS            Stats `json:"fork16_ms"`
	// Fork16WarmMS is fork ×16 after Prewarm made 16 standbys ready (background work,
	// timed in Prewarm16S).
	Fork16WarmMS Stats   `json:"fork16_warm_ms"`
	Prewarm16S   float64 `json:"prewarm16_s"`
	CreateMS     Stats   `json:"create_ms"`
	// Standby counts the standby work of the whole W1 run (prepared, taken by rollbacks
	// and forks, missed). Prewarm's standbys count as prepared, but their time is not in
	// BackgroundMS (Prewarm runs in the foreground; see Prewarm16S).
	Standby engine.Stats `json:"standby"`
	// BackgroundMSPerCheckpoint is the engine's background work (standby restores,
	// retiring replaced trees) during the steps and rollbacks, waited for at their end,
	// divided by the checkpoints taken there: what a checkpoint costs off its critical
	// path.
	BackgroundMSPerCheckpoint float64 `json:"background_ms_per_checkpoint"`
	// W2 and W3 are present when those workloads ran.
	W2 *W2Report `json:"w2,omitempty"`
	W3 *W3Report `json:"w3,omitempty"`

	// StorageBytesPerCheckpoint is, for each checkpoint of the first Iterations steps,
	// the pool filesystem's used-bytes delta from before its step to after it (syncfs
	// before each statfs, off the clock; btrfs shares extents, so this is the cost after
	// sharing, the step's own file writes included) plus its process images' bytes once
	// compacted. ImageBytesPerCheckpoint is the images alone.
	StorageBytesPerCheckpoint Stats `json:"storage_bytes_per_checkpoint"`
	// ImageDiskBytesPerCheckpoint is, where images are on the image pool, what each
	// checkpoint after the base added to it on average, as the filesystem counts it
	// (shared and compressed), measured around all of them once their background work is
	// done; StorageRatio's mean then uses it for the images, as ImageBytesPerCheckpoint
	// counts their own pages uncompressed.
	ImageDiskBytesPerCheckpoint float64 `json:"image_disk_bytes_per_checkpoint,omitempty"`
	// BaseCheckpointBytes is the same for the sandbox's first checkpoint, taken of W1's
	// state before the first step: it holds that whole state (the REPL's 40 MB dict),
	// which no step changed, so it is not one of StorageBytesPerCheckpoint's.
	BaseCheckpointBytes     int64 `json:"base_checkpoint_bytes"`
	ImageBytesPerCheckpoint Stats `json:"image_bytes_per_checkpoint"`
	// DumpedImageBytesPerCheckpoint is what each checkpoint's dump wrote on its critical
	// path, before background compaction reduced it to ImageBytesPerCheckpoint.
	DumpedImageBytesPerCheckpoint Stats `json:"dumped_image_bytes_per_checkpoint"`
	// StandbysHeld and StandbyMemoryBytes are the standby cache at the end of the run:
	// frozen restored copies and the memory they hold.
	StandbysHeld       int   `json:"standbys_held"`
	StandbyMemoryBytes int64 `json:"standby_memory_bytes"`
	// ResidentMemoryBytes is the memory the W1 sandbox's zygotes hold beyond its
	// processes' after the rollbacks (Sandbox.ResidentMemoryBytes), ResidentsHeld how
	// many of its checkpoints are then resident.
	ResidentMemoryBytes int64 `json:"resident_memory_bytes"`
	ResidentsHeld       int   `json:"residents_held"`
	// StepChangedBytes estimates what one step changes: the 3 edited files and git's
	// index (each rewritten whole), the 1 MiB str added to the heap, the 10 rows.
	StepChangedBytes int64 `json:"step_changed_bytes"`
	// StorageRatio is the mean storage per checkpoint / StepChangedBytes: the mean of
	// StorageBytesPerCheckpoint, or with the image pool the filesystem deltas of the
	// steps plus ImageDiskBytesPerCheckpoint.
	StorageRatio float64 `json:"storage_ratio"`
	// OverheadRSSBytes is the sandbox's overhead beyond its own processes: the RSS of
	// its init (cairn-init).
	OverheadRSSBytes int64 `json:"overhead_rss_bytes"`

	// Baselines by name ("runc_criu", "runsc", "copytree"); absent unless
	// Options.Baselines.
	Baselines map[string]*BaselineReport `json:"baselines,omitempty"`
	// Ratios by baseline name: the baseline's p50 over cairn's (above 1: cairn faster).
	Ratios map[string]Ratios `json:"ratios,omitempty"`

	Correctness Correctness `json:"correctness"`

	// Backends holds each measured backend's figures by isolation name.
	Backends map[string]*BackendReport `json:"backends,omitempty"`
}

// BaselineReport is one baseline's measurements, or why it could not run. Its keys are
// the top level's, measured the same way: checkpoint after each step, rollback to a
// random one of its checkpoints, fork ×16 from one checkpoint until all 16 run.
type BaselineReport struct {
	Method       string `json:"method"`
	Error        string `json:"error,omitempty"`
	CheckpointMS Stats  `json:"checkpoint_ms"`
	RollbackMS   Stats  `json:"rollback_ms"`
	Fork16MS     Stats  `json:"fork16_ms"`
	// StorageBytesPerCheckpoint is the pool's used-bytes delta around each checkpoint,
	// as for cairn; the baselines write their images into the pool, so it holds the
	// images too (cairn's are outside: its figure adds ImageBytes). ImageBytes is the
	// size of the image files alone.
	StorageBytesPerCheckpoint Stats `json:"storage_bytes_per_checkpoint"`
	ImageBytesPerCheckpoint   Stats `json:"image_bytes_per_checkpoint"`
	// StepChangedBytes is the baseline's own step estimated as cairn's is (edited files,
	// 1 MiB of heap, 10 rows); StorageRatio is mean StorageBytesPerCheckpoint over it.
	StepChangedBytes int64   `json:"step_changed_bytes"`
	StorageRatio     float64 `json:"storage_ratio"`
	// NotMeasured names the keys left zero on purpose, and why.
	NotMeasured string `json:"not_measured,omitempty"`
	// Checks counts the REPL state checks after the baseline's rollbacks and forks that
	// passed (a failed one ends the baseline with an Error).
	Checks int `json:"checks_passed"`
}

// Ratios compare a baseline's p50 with cairn's (Storage: storage ratio over cairn's).
// Above 1, cairn is faster (or smaller); 0 when either side was not measured.
type Ratios struct {
	Checkpoint float64 `json:"checkpoint"`
	Rollback   float64 `json:"rollback"`
	Fork16     float64 `json:"fork16"`
	Storage    float64 `json:"storage"`
}

// Correctness counts the checks after rollbacks and forks.
type Correctness struct {
	Passed   int      `json:"passed"`
	Failed   int      `json:"failed"`
	Failures []string `json:"failures,omitempty"`
}

func (c *Correctness) add(what string, err error) {
	if err == nil {
		c.Passed++
		return
	}
	c.Failed++
	c.Failures = append(c.Failures, what+": "+err.Error())
}

// runner holds one run's state.
type runner struct {
	e          *engine.Engine
	opts       Options
	rep        *Report
	w          *w1
	rng        *rand.Rand
	ckMS, rbMS []float64
	stoppedMS  []float64            // the resident checkpoints' "stopped" phase
	iso        string               // isolation backend of the sandboxes created
	phases     map[string][]float64 // checkpoint phase timings, by phase
	rbPhases   map[string][]float64 // rollback phase timings, by phase
	// stepCks are the checkpoints of the measured steps and stepFS the pool bytes each
	// added; their images are measured again once background compaction is done.
	stepCks []string
	stepFS  []float64
	// baseCk is the base checkpoint (measureSteps) and baseFS the pool bytes it added;
	// imgUsed0 the image pool's usage once its images were written.
	baseCk   string
	baseFS   float64
	imgUsed0 int64
}

func (b *runner) phase(format string, args ...any) {
	if b.opts.Progress != nil {
		fmt.Fprintf(b.opts.Progress, "%s: %s\n", b.opts.Workload, fmt.Sprintf(format, args...))
	}
}

// Run runs a workload on e and returns its report. A baseline that cannot run records
// its error in the report; a failed correctness check is counted, not returned.
func Run(ctx context.Context, e *engine.Engine, opts Options) (*Report, error) {
	switch opts.Workload {
	case "":
		opts.Workload = "w1"
	case "w1", "w2", "w3", "all":
	default:
		return nil, errdefs.InvalidArgument("workload %q: give w1, w2, w3 or all", opts.Workload)
	}
	if opts.Iterations == 0 {
		opts.Iterations = 20
	}
	if opts.Iterations < 1 {
		return nil, errdefs.InvalidArgument("iterations %d: give at least 1", opts.Iterations)
	}
	if opts.Timeline != nil {
		ctx = context.WithValue(ctx, timelineKey{}, &timeline{w: opts.Timeline})
	}
	if len(opts.Isolation) == 0 {
		opts.Isolation = []string{"container"}
	}
	return runBackends(ctx, e, opts)
}

// runWorkloads runs the workloads opts.Workload names.
func (b *runner) runWorkloads(ctx context.Context) error {
	w := b.opts.Workload
	if w == "w1" || w == "all" {
		if err := b.runW1(ctx); err != nil {
			return err
		}
	}
	var err error
	if w == "w2" || w == "all" {
		if b.rep.W2, err = b.runW2(ctx); err != nil {
			return fmt.Errorf("w2: %w", err)
		}
	}
	if w == "w3" || w == "all" {
		if b.rep.W3, err = b.runW3(ctx, b.opts.Iterations); err != nil {
			return fmt.Errorf("w3: %w", err)
		}
	}
	return nil
}

// runW1 sets W1 up, runs every measurement, then the baselines, and cleans up.
func (b *runner) runW1(ctx context.Context) (err error) {
	n := b.opts.Iterations
	b.settle(ctx)
	b.phase("setting up the W1 sandbox (repo, REPL with a 40 MB dict, sqlite, bash)")
	b.w, err = setupW1(ctx, b.e, b.iso)
	if b.w != nil {
		defer b.cleanup(context.WithoutCancel(ctx))
	}
	if err != nil {
		return err
	}
	b.w.ckPhases = b.phases
	if b.rep.OverheadRSSBytes, err = b.overheadRSS(ctx); err != nil {
		return err
	}
	before := b.e.Stats()
	defer func() {
		b.e.Quiesce()
		b.rep.Standby = statsDelta(before, b.e.Stats())
		b.rep.StandbysHeld, b.rep.StandbyMemoryBytes, _ = b.e.StandbyMemory(context.WithoutCancel(ctx))
	}()
	b.phase("%d steps, each followed by a checkpoint", n)
	if err := b.measureSteps(ctx, n); err != nil {
		return err
	}
	b.phase("%d rollbacks to random ancestors (each followed by a step and a checkpoint)", n)
	if err := b.measureRollbacks(ctx, n); err != nil {
		return err
	}
	// Wait for the background work of the checkpoints (untimed), so that it is counted
	// whole and not in the forks that follow.
	b.e.Quiesce()
	b.rep.BackgroundMSPerCheckpoint = statsDelta(before, b.e.Stats()).BackgroundMS / float64(len(b.ckMS))
	if err := b.finishStorage(ctx); err != nil {
		return err
	}
	if err := b.residents(ctx); err != nil {
		return err
	}
	for _, f := range []struct {
		count, reps int
		out         *Stats
	}{{1, n, &b.rep.Fork1MS}, {4, max(2, n/4), &b.rep.Fork4MS}, {16, max(2, n/10), &b.rep.Fork16MS}} {
		b.phase("fork ×%d, %d times", f.count, f.reps)
		if *f.out, err = b.measureForks(ctx, f.count, f.reps); err != nil {
			return err
		}
	}
	b.phase("fork ×16 after prewarming 16 standbys, %d times", max(2, n/10))
	if err := b.measureWarmForks(ctx, max(2, n/10)); err != nil {
		return err
	}
	b.phase("create from the template, %d times", n)
	if err := b.measureCreate(ctx, n); err != nil {
		return err
	}
	if b.opts.Baselines {
		b.runBaselines(ctx)
	}
	return nil
}

// cleanup removes the W1 sandbox and every checkpoint it took.
func (b *runner) cleanup(ctx context.Context) {
	b.phase("cleaning up")
	b.e.Remove(ctx, b.w.id)
	for ck, parent := range b.w.parent {
		if parent == "" {
			b.e.DeleteCheckpoint(ctx, ck, true)
		}
	}
}
