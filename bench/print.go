package bench

import (
	"fmt"
	"io"
	"sort"
	"text/tabwriter"
)

// Print writes the report as human-readable tables: p50/p95/p99 per operation, the
// storage figures, the baselines and cairn's ratios against them.
func (r *Report) Print(w io.Writer) {
	m := r.Machine
	fmt.Fprintf(w, "workload %s, %d iterations, %.1f s; Linux %s, %d CPUs, %.1f GiB, CRIU %d, %s\n\n",
		r.Workload, r.Iterations, r.DurationS, m.Kernel, m.CPUs, float64(m.MemBytes)/(1<<30), m.CRIU, m.Go)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "operation\tn\tp50 ms\tp95 ms\tp99 ms\tmean ms\t")
	for _, op := range []struct {
		name string
		s    Stats
	}{{"checkpoint", r.CheckpointMS}, {"rollback", r.RollbackMS}, {"fork ×1", r.Fork1MS},
		{"fork ×4", r.Fork4MS}, {"fork ×16", r.Fork16MS}, {"create", r.CreateMS}} {
		printStats(tw, op.name, op.s)
	}
	tw.Flush()
	s := r.StorageBytesPerCheckpoint
	fmt.Fprintf(w, "\nstorage per checkpoint: p50 %s, p95 %s, mean %s (process images alone: p50 %s)\n",
		mib(s.P50), mib(s.P95), mib(s.Mean), mib(r.ImageBytesPerCheckpoint.P50))
	fmt.Fprintf(w, "bytes changed by a step: %s; storage ratio %.1f\n", mib(float64(r.StepChangedBytes)), r.StorageRatio)
	fmt.Fprintf(w, "sandbox overhead (cairn-init RSS): %s\n", mib(float64(r.OverheadRSSBytes)))
	fmt.Fprintf(w, "correctness checks: %d passed, %d failed\n", r.Correctness.Passed, r.Correctness.Failed)
	for _, f := range r.Correctness.Failures {
		fmt.Fprintf(w, "  FAILED %s\n", f)
	}
	r.printBaselines(w)
	r.printBackends(w)
}

func (r *Report) printBaselines(w io.Writer) {
	if len(r.Baselines) == 0 {
		return
	}
	names := make([]string, 0, len(r.Baselines))
	for n := range r.Baselines {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintln(w, "\nbaselines (same run, same machine):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "operation\tn\tp50 ms\tp95 ms\tp99 ms\tmean ms\tcairn speed-up (p50)\t")
	for _, n := range names {
		bl := r.Baselines[n]
		if bl.Error != "" {
			continue
		}
		printStats(tw, n+" checkpoint", bl.CheckpointMS, fmt.Sprintf("%.1f×", r.Ratios[n].Checkpoint))
		printStats(tw, n+" rollback", bl.RollbackMS, fmt.Sprintf("%.1f×", r.Ratios[n].Rollback))
	}
	tw.Flush()
	for _, n := range names {
		bl := r.Baselines[n]
		if bl.Error != "" {
			fmt.Fprintf(w, "%s: DID NOT RUN: %s\n", n, bl.Error)
		} else {
			fmt.Fprintf(w, "%s: %s (%d state checks passed)\n", n, bl.Method, bl.Checks)
		}
	}
}

func printStats(w io.Writer, name string, s Stats, extra ...string) {
	fmt.Fprintf(w, "%s\t%d\t%.1f\t%.1f\t%.1f\t%.1f\t", name, s.N, s.P50, s.P95, s.P99, s.Mean)
	for _, e := range extra {
		fmt.Fprintf(w, "%s\t", e)
	}
	fmt.Fprintln(w)
}

func mib(b float64) string { return fmt.Sprintf("%.2f MiB", b/(1<<20)) }
