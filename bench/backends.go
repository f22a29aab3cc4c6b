package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/cairn-sandbox/cairn/engine"
)

// BackendReport is W1 measured on one isolation backend. The top-level figures of a
// Report are those of the container backend (the keys earlier reports had); Backends
// holds every backend's, side by side.
type BackendReport struct {
	Isolation    string `json:"isolation"`
	Error        string `json:"error,omitempty"`
	CheckpointMS Stats  `json:"checkpoint_ms"`
	RollbackMS   Stats  `json:"rollback_ms"`
	Fork1MS      Stats  `json:"fork1_ms"`
	Fork4MS      Stats  `json:"fork4_ms"`
	Fork16MS     Stats  `json:"fork16_ms"`
	CreateMS     Stats  `json:"create_ms"`
	// CheckpointPhasesP50MS is where a checkpoint's time goes: the median of each phase
	// the engine and the backend report (sync, freeze, dump, fs_snapshot, thaw, publish).
	CheckpointPhasesP50MS map[string]float64 `json:"checkpoint_phases_p50_ms"`
	// RollbackPhasesP50MS is the same for W1's rollbacks (lock, lookup, kill,
	// revert_snapshot, revert_send, revert_apply, spawn, reload, ...); a phase a
	// rollback's path did not take is not counted for it.
	RollbackPhasesP50MS map[string]float64 `json:"rollback_phases_p50_ms"`
	// RollbacksRewound counts the rollbacks that brought the processes back in place
	// (a rewind), RewindsRefused those a rewind was tried for and refused (they forked
	// from the zygotes).
	RollbacksRewound int `json:"rollbacks_rewound"`
	RewindsRefused   int `json:"rewinds_refused"`
	// RewindsRefusedForCopy are the refused whose pages to bring back were too many
	// (more than a fork shares for the same time: W2's rollbacks to other branches).
	RewindsRefusedForCopy     int   `json:"rewinds_refused_for_copy"`
	StorageBytesPerCheckpoint Stats `json:"storage_bytes_per_checkpoint"`
	ImageBytesPerCheckpoint   Stats `json:"image_bytes_per_checkpoint"`
	// OverheadRSSBytes is the RSS of the process Running watches: cairn-init for a
	// container; gVisor's sentry, which also holds the sandbox's memory, for gvisor.
	OverheadRSSBytes int64 `json:"overhead_rss_bytes"`
	// BackgroundMSPerCheckpoint is as in Report.
	BackgroundMSPerCheckpoint float64     `json:"background_ms_per_checkpoint"`
	Correctness               Correctness `json:"correctness"`
}

// runBackends runs W1 once per backend in opts.Isolation; the baselines run with the
// first. The returned report's top-level figures are the container backend's (or the
// first backend's when container is not measured).
func runBackends(ctx context.Context, e *engine.Engine, opts Options) (*Report, error) {
	var primary *Report
	backends := map[string]*BackendReport{}
	var firstErr error
	warmup, err := warmMemory(opts.Progress, opts.WarmMemory, 0)
	if err != nil && opts.Progress != nil {
		fmt.Fprintf(opts.Progress, "bench: memory warm-up: %v\n", err)
	}
	if opts.Seed == 0 {
		opts.Seed = uint64(time.Now().UnixNano())
	}
	for i, iso := range opts.Isolation {
		o := opts
		o.Baselines = opts.Baselines && i == 0
		b := &runner{e: e, opts: o, iso: iso, rng: rand.New(rand.NewPCG(opts.Seed, 1)),
			rep:    &Report{Workload: o.Workload, Iterations: o.Iterations, StartedAt: time.Now().UTC(), Seed: opts.Seed},
			phases: map[string][]float64{}, rbPhases: map[string][]float64{}}
		b.rep.Machine = machineInfo()
		b.rep.Machine.MemoryWarmup = warmup
		b.rep.StandbyRestores = opts.StandbyRestores
		b.phase("isolation %s", iso)
		steal0, total0 := cpuTimes()
		err := b.runWorkloads(ctx)
		b.rep.Machine.StealPercent = stealSince(steal0, total0)
		b.rep.CheckpointMS = summarize(b.ckMS)
		b.rep.CheckpointStoppedMS = summarize(b.stoppedMS)
		b.rep.RollbackMS = summarize(b.rbMS)
		b.rep.DurationS = time.Since(b.rep.StartedAt).Seconds()
		br := b.backendReport()
		if err != nil {
			br.Error = err.Error()
			if firstErr == nil {
				firstErr = fmt.Errorf("isolation %s: %w", iso, err)
			}
		}
		backends[iso] = br
		if primary == nil || iso == "container" {
			if primary != nil {
				b.rep.Baselines, b.rep.Ratios = primary.Baselines, primary.Ratios
			}
			primary = b.rep
		}
	}
	primary.Backends = backends
	// Correctness of the whole run counts every backend's checks.
	primary.Correctness = Correctness{}
	for _, iso := range opts.Isolation {
		c := backends[iso].Correctness
		primary.Correctness.Passed += c.Passed
		primary.Correctness.Failed += c.Failed
		for _, f := range c.Failures {
			primary.Correctness.Failures = append(primary.Correctness.Failures, iso+": "+f)
		}
	}
	return primary, firstErr
}

func (b *runner) backendReport() *BackendReport {
	r := b.rep
	br := &BackendReport{Isolation: b.iso, CheckpointMS: r.CheckpointMS, RollbackMS: r.RollbackMS,
		Fork1MS: r.Fork1MS, Fork4MS: r.Fork4MS, Fork16MS: r.Fork16MS, CreateMS: r.CreateMS,
		StorageBytesPerCheckpoint: r.StorageBytesPerCheckpoint, ImageBytesPerCheckpoint: r.ImageBytesPerCheckpoint,
		OverheadRSSBytes: r.OverheadRSSBytes, BackgroundMSPerCheckpoint: r.BackgroundMSPerCheckpoint,
		Correctness: r.Correctness, CheckpointPhasesP50MS: p50s(b.phases), RollbackPhasesP50MS: p50s(b.rbPhases),
		RollbacksRewound: len(b.rbPhases["rewound"]), RewindsRefused: len(b.rbPhases["rewind_refused"]),
		RewindsRefusedForCopy: len(b.rbPhases["rewind_refused_copy"])}
	return br
}

// printBackends writes the per-backend table, side by side.
func (r *Report) printBackends(w io.Writer) {
	if len(r.Backends) < 2 {
		return
	}
	names := make([]string, 0, len(r.Backends))
	for n := range r.Backends {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintln(w, "\nbackends side by side (p50 / p95 ms):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "operation\t")
	for _, n := range names {
		fmt.Fprintf(tw, "%s\t", n)
	}
	fmt.Fprintln(tw)
	row := func(op string, get func(*BackendReport) Stats) {
		fmt.Fprintf(tw, "%s\t", op)
		for _, n := range names {
			s := get(r.Backends[n])
			fmt.Fprintf(tw, "%.1f / %.1f\t", s.P50, s.P95)
		}
		fmt.Fprintln(tw)
	}
	row("checkpoint", func(b *BackendReport) Stats { return b.CheckpointMS })
	row("rollback", func(b *BackendReport) Stats { return b.RollbackMS })
	row("fork ×1", func(b *BackendReport) Stats { return b.Fork1MS })
	row("fork ×4", func(b *BackendReport) Stats { return b.Fork4MS })
	row("fork ×16", func(b *BackendReport) Stats { return b.Fork16MS })
	row("create", func(b *BackendReport) Stats { return b.CreateMS })
	tw.Flush()
	for _, n := range names {
		br := r.Backends[n]
		printPhases(w, n+" ", "checkpoint", br.CheckpointPhasesP50MS)
		printPhases(w, n+" ", "rollback", br.RollbackPhasesP50MS)
		fmt.Fprintf(w, "%s: image p50 %s; overhead RSS %s; checks %d passed, %d failed\n",
			n, mib(br.ImageBytesPerCheckpoint.P50), mib(float64(br.OverheadRSSBytes)), br.Correctness.Passed, br.Correctness.Failed)
		if br.Error != "" {
			fmt.Fprintf(w, "%s: FAILED: %s\n", n, br.Error)
		}
	}
}

// p50s is the median of each phase's samples.
func p50s(phases map[string][]float64) map[string]float64 {
	out := map[string]float64{}
	for name, v := range phases {
		out[name] = summarize(v).P50
	}
	return out
}
