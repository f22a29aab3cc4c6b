package bench

import (
	"fmt"
	"io"
	"sort"
	"text/tabwriter"

	"github.com/cairn-sandbox/cairn/engine"
)

type engineStats = engine.Stats

// Print writes the report as human-readable tables: p50/p95/p99 per operation, the
// storage figures, the baselines and cairn's ratios against them.
func (r *Report) Print(w io.Writer) {
	m := r.Machine
	fmt.Fprintf(w, "workload %s, %d iterations, %.1f s; Linux %s, %d CPUs, %.1f GiB, CRIU %d, %s",
		r.Workload, r.Iterations, r.DurationS, m.Kernel, m.CPUs, float64(m.MemBytes)/(1<<30), m.CRIU, m.Go)
	if m.PageReporting != "" {
		fmt.Fprintf(w, ", free page reporting %s", m.PageReporting)
	}
	if m.CPUModel != "" || m.THP != "" {
		fmt.Fprintf(w, "\n%s; transparent huge pages %s; a page fault costs %.1f µs", m.CPUModel, m.THP, m.PageFaultUS)
		if m.THP != "always" && m.PageFaultUS > 5 {
			fmt.Fprint(w, " (slow: restores fault their memory in 4 KiB at a time; scripts/install-deps.sh sets THP to always)")
		}
	}
	fmt.Fprintf(w, "\nCPU time taken by the hypervisor for other guests during the run (steal): %.1f%%", m.StealPercent)
	if m.StealPercent > 5 {
		fmt.Fprint(w, " (a shared host under load: every time below is stretched; compare ratios, or rerun)")
	}
	if mw := m.MemoryWarmup; mw != nil {
		fmt.Fprintf(w, "\nfree memory's first write %.2f GiB/s", mw.FirstTouchGiBps)
		if mw.Skipped != "" {
			fmt.Fprintf(w, "; not warmed: %s", mw.Skipped)
		} else {
			fmt.Fprintf(w, "; %.1f GiB warmed first, at %.2f GiB/s, in %.1f s", float64(mw.WarmedBytes)/(1<<30), mw.WarmGiBps, mw.Seconds)
		}
	}
	fmt.Fprint(w, "\n\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "operation\tn\tp50 ms\tp95 ms\tp99 ms\tmean ms\t")
	for _, op := range []struct {
		name string
		s    Stats
	}{{"checkpoint", r.CheckpointMS}, {"  sandbox stopped", r.CheckpointStoppedMS}, {"rollback", r.RollbackMS}, {"fork ×1", r.Fork1MS},
		{"fork ×4", r.Fork4MS}, {"fork ×16", r.Fork16MS}, {"fork ×16 (warm)", r.Fork16WarmMS}, {"create", r.CreateMS}} {
		if op.s.N > 0 {
			printStats(tw, op.name, op.s)
		}
	}
	tw.Flush()
	if r.CheckpointMS.N == 0 {
		r.printSearch(w)
		return
	}
	st := r.Standby
	fmt.Fprintf(w, "\nstandbys: %d prepared in the background (%.0f ms each on average), %d taken by rollbacks/forks, %d misses (restore path), %d evicted; prewarming 16: %.2f s\n",
		st.StandbysPrepared, perPrepared(st), st.StandbysClaimed, st.StandbyMisses, st.StandbysEvicted, r.Prewarm16S)
	fmt.Fprintf(w, "standbys held at the end: %d, %s of memory\n", r.StandbysHeld, mib(float64(r.StandbyMemoryBytes)))
	fmt.Fprintf(w, "resident checkpoints after the rollbacks: %d, their zygotes holding %s beyond the processes' memory (%d evicted for the count cap or the memory bound, %d of them for memory)\n",
		r.ResidentsHeld, mib(float64(r.ResidentMemoryBytes)), r.Standby.ResidentsEvicted, r.Standby.ResidentsEvictedForMemory)
	fmt.Fprintf(w, "background work per checkpoint (off the critical path): %.1f ms\n", r.BackgroundMSPerCheckpoint)
	if st.Compactions > 0 {
		fmt.Fprintf(w, "images compacted against their parent's: %d, %.0f ms each on average\n", st.Compactions, st.CompactionMS/float64(st.Compactions))
	}
	printResident(w, "", st)
	if br := r.Backends[r.primaryIsolation()]; br != nil {
		printPhases(w, "", "checkpoint", br.CheckpointPhasesP50MS)
		printPhases(w, "", "rollback", br.RollbackPhasesP50MS)
		printRewinds(w, "", br.RollbacksRewound, br.RewindsRefused, br.RewindsRefusedForCopy)
	}
	s := r.StorageBytesPerCheckpoint
	fmt.Fprintf(w, "\nstorage per checkpoint: p50 %s, p95 %s, p99 %s, mean %s (process images alone: p50 %s; dumped on the critical path: p50 %s)\n",
		mib(s.P50), mib(s.P95), mib(s.P99), mib(s.Mean), mib(r.ImageBytesPerCheckpoint.P50), mib(r.DumpedImageBytesPerCheckpoint.P50))
	fmt.Fprintf(w, "bytes changed by a step: %s; storage ratio %.1f; the base checkpoint (W1's state before the steps): %s\n",
		mib(float64(r.StepChangedBytes)), r.StorageRatio, mib(float64(r.BaseCheckpointBytes)))
	if r.ImageDiskBytesPerCheckpoint > 0 {
		fmt.Fprintf(w, "images on the image pool: %s a checkpoint on disk (shared with the parent's, compressed)\n", mib(r.ImageDiskBytesPerCheckpoint))
	}
	fmt.Fprintf(w, "sandbox overhead (cairn-init RSS): %s\n", mib(float64(r.OverheadRSSBytes)))
	fmt.Fprintf(w, "correctness checks: %d passed, %d failed\n", r.Correctness.Passed, r.Correctness.Failed)
	for _, f := range r.Correctness.Failures {
		fmt.Fprintf(w, "  FAILED %s\n", f)
	}
	r.printBaselines(w)
	r.printBackends(w)
	r.printSearch(w)
}

// printResident writes where resident checkpoints' rollbacks went and what their roots'
// reverts cost, if any.
func printResident(w io.Writer, indent string, st engineStats) {
	if st.ResidentRollbacks+st.InPlaceRestores+st.DurableCopies == 0 {
		return
	}
	fmt.Fprintf(w, "%sresident checkpoints: %d rollbacks through zygotes, %d restored in place; %d durable copies (%.0f ms each), %d evicted\n",
		indent, st.ResidentRollbacks, st.InPlaceRestores, st.DurableCopies, per(st.DurableMS, st.DurableCopies), st.ResidentsEvicted)
	if st.Reverts > 0 {
		n := float64(st.Reverts)
		fmt.Fprintf(w, "%sroots reverted in place: %d (%d planned from the head, %d read from the trees, %.0f inodes compared each), on average %.0f operations: snapshot of the live root %.1f ms, difference %.1f ms, apply %.1f ms\n",
			indent, st.Reverts, st.PlannedReverts, st.TreeReverts, per(float64(st.RevertCompared), st.TreeReverts), float64(st.RevertOps)/n, st.RevertSnapshotMS/n, st.RevertSendMS/n, st.RevertApplyMS/n)
	}
}

// printRewinds writes how many rollbacks were rewound in place and how many refused,
// if any was tried.
func printRewinds(w io.Writer, indent string, rewound, refused, forCopy int) {
	if rewound+refused > 0 {
		fmt.Fprintf(w, "%srollbacks rewound in place: %d; rewinds refused (forked from the zygotes): %d, %d of them for the pages to bring back\n", indent, rewound, refused, forCopy)
	}
}

// printPhases writes the median of each phase of an operation, in name order; phases
// may overlap (a snapshot taken while processes fork), so they need not add up.
func printPhases(w io.Writer, indent, op string, p50 map[string]float64) {
	if len(p50) == 0 {
		return
	}
	names := make([]string, 0, len(p50))
	for n := range p50 {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintf(w, "%s%s phases (p50 ms):", indent, op)
	for _, n := range names {
		fmt.Fprintf(w, " %s %.1f", n, p50[n])
	}
	fmt.Fprintln(w)
}

// per is total / n, 0 when n is.
func per(total float64, n int) float64 {
	if n == 0 {
		return 0
	}
	return total / float64(n)
}

func perPrepared(st engineStats) float64 {
	return per(st.StandbyPrepareMS, st.StandbysPrepared)
}

// printSearch writes the W2 and W3 results, if any.
func (r *Report) printSearch(w io.Writer) {
	if r.W2 != nil {
		x := r.W2
		fmt.Fprintf(w, "\nW2 (MCTS replay): %d expansions, %d rollbacks: %.1f s vs %.1f s with no snapshots: overhead %.1f%%\n",
			x.Expansions, x.Rollbacks, x.TotalS, x.FloorS, x.OverheadPct)
		fmt.Fprintf(w, "  checkpoint p50/p95/p99 %.1f/%.1f/%.1f ms, rollback %.1f/%.1f/%.1f ms; standbys taken %d, misses %d\n",
			x.CheckpointMS.P50, x.CheckpointMS.P95, x.CheckpointMS.P99, x.RollbackMS.P50, x.RollbackMS.P95, x.RollbackMS.P99,
			x.Standby.StandbysClaimed, x.Standby.StandbyMisses)
		fmt.Fprintf(w, "  step p50/p95/p99 %.1f/%.1f/%.1f ms in the search, %.1f/%.1f/%.1f ms without snapshots; its REPL statement %.1f/%.1f/%.1f and %.1f/%.1f/%.1f ms\n",
			x.StepMS.P50, x.StepMS.P95, x.StepMS.P99, x.FloorStepMS.P50, x.FloorStepMS.P95, x.FloorStepMS.P99,
			x.REPLMS.P50, x.REPLMS.P95, x.REPLMS.P99, x.FloorREPLMS.P50, x.FloorREPLMS.P95, x.FloorREPLMS.P99)
		fmt.Fprintf(w, "  rollbacks went p50 %.0f, max %.0f steps in the tree (to the common ancestor and back down)\n", x.RollbackSteps.P50, x.RollbackSteps.Max)
		printResident(w, "  ", x.Standby)
		printPhases(w, "  ", "checkpoint", x.CheckpointPhasesP50MS)
		printPhases(w, "  ", "rollback", x.RollbackPhasesP50MS)
		printRewinds(w, "  ", x.RollbacksRewound, x.RewindsRefused, x.RewindsRefusedForCopy)
	}
	if r.W3 != nil {
		x := r.W3
		fmt.Fprintf(w, "\nW3 (RL fan-out): %d sandboxes × %d rounds: %.0f resets/s, reset p50/p95/p99 %.1f/%.1f/%.1f ms, round p50 %.2f s; standbys taken %d, misses %d\n",
			x.Sandboxes, x.Rounds, x.ResetsPS, x.ResetMS.P50, x.ResetMS.P95, x.ResetMS.P99, x.RoundS.P50,
			x.Standby.StandbysClaimed, x.Standby.StandbyMisses)
	}
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
		printStats(tw, n+" checkpoint", bl.CheckpointMS, speedup(r.Ratios[n].Checkpoint))
		printStats(tw, n+" rollback", bl.RollbackMS, speedup(r.Ratios[n].Rollback))
		if bl.Fork16MS.N > 0 {
			printStats(tw, n+" fork ×16", bl.Fork16MS, speedup(r.Ratios[n].Fork16))
		}
	}
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "storage per checkpoint\tp50\tp95\tp99\timages p50\tstep changes\tratio\tratio ÷ cairn\t")
	fmt.Fprintf(tw, "cairn\t%s\t%s\t%s\t%s\t%s\t%.1f\t\t\n", mib(r.StorageBytesPerCheckpoint.P50), mib(r.StorageBytesPerCheckpoint.P95),
		mib(r.StorageBytesPerCheckpoint.P99), mib(r.ImageBytesPerCheckpoint.P50), mib(float64(r.StepChangedBytes)), r.StorageRatio)
	for _, n := range names {
		bl := r.Baselines[n]
		if bl.Error != "" {
			continue
		}
		s := bl.StorageBytesPerCheckpoint
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%.1f\t%s\t\n", n, mib(s.P50), mib(s.P95), mib(s.P99),
			mib(bl.ImageBytesPerCheckpoint.P50), mib(float64(bl.StepChangedBytes)), bl.StorageRatio, speedup(r.Ratios[n].Storage))
	}
	tw.Flush()
	for _, n := range names {
		bl := r.Baselines[n]
		if bl.Error != "" {
			fmt.Fprintf(w, "%s: DID NOT RUN: %s\n", n, bl.Error)
			continue
		}
		fmt.Fprintf(w, "%s: %s (%d state checks passed)\n", n, bl.Method, bl.Checks)
		if bl.NotMeasured != "" {
			fmt.Fprintf(w, "  not measured: %s\n", bl.NotMeasured)
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

// speedup formats a ratio, "-" when it is unknown.
func speedup(r float64) string {
	if r == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f×", r)
}

func mib(b float64) string { return fmt.Sprintf("%.2f MiB", b/(1<<20)) }

// primaryIsolation names the backend whose figures are the report's top-level ones:
// container when it was measured, else the only one.
func (r *Report) primaryIsolation() string {
	if _, ok := r.Backends["container"]; ok || len(r.Backends) != 1 {
		return "container"
	}
	for n := range r.Backends {
		return n
	}
	return ""
}
