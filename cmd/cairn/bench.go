package main

import (
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/bench"
)

func newBenchCmd(a *app) *cobra.Command {
	var (
		opts        bench.Options
		noBaselines bool
		timeline    bool
	)
	cmd := &cobra.Command{
		Use:   "bench [flags]",
		Short: "Measure cairn on a reference workload",
		Long: `Bench runs a reference workload and reports latency percentiles of checkpoint,
rollback, fork and create, the storage each checkpoint adds, and the correctness of
every rollback and fork (each is checked against the state recorded at its
checkpoint). Unless --no-baselines, the baselines runc_criu (runc checkpoint/restore
with CRIU + btrfs snapshots), runsc (gVisor's runsc checkpoint/restore + btrfs
snapshots) and copytree are measured in the same run with the same keys (checkpoint,
rollback, fork ×16 as p50/p95/p99, storage ratio), and cairn's ratios against them
reported; a baseline that cannot run (say, runsc missing) records why in the report.
The background work each checkpoint causes is reported apart from its critical path.
Each backend of --isolation runs the whole workload; the report puts them side by side.

Workload w1 is the coding-agent sandbox: an idle bash, a Python REPL holding a large
dict, an open sqlite transaction and a suspended generator, and a git repository of
1,000 files. w2 replays an MCTS-shaped tree search on it (100 expansions, 49 after a
rollback) against the same 100 steps with no snapshots, and reports the overhead. w3
forks 16 sandboxes from one warm checkpoint and resets them to it, --iterations
rounds, and reports resets per second. "all" runs the three. Progress goes to standard
error; the report to standard output (the report as JSON with --json). Exits 1 if a
correctness check failed.`,
		Example: `  cairn bench
  cairn bench --iterations 50 --no-baselines
  cairn bench --isolation gvisor --no-baselines
  cairn bench --json > w1.json
  cairn bench --workload all --no-baselines
  cairn bench --workload all --no-baselines --standby-restores 2
  cairn bench --no-baselines --seed 42      # the same rollback targets as any run with seed 42
  cairn bench --no-baselines --timeline 2> phases.txt   # where each checkpoint's and rollback's time went`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			opts.Baselines = !noBaselines
			opts.Progress = os.Stderr
			if timeline {
				opts.Timeline = os.Stderr
			}
			a.standbyRestores = opts.StandbyRestores
			e, err := a.engine(cmd.Context())
			if err != nil {
				return err
			}
			rep, err := bench.Run(cmd.Context(), e, opts)
			if err != nil {
				if rep != nil && !a.json {
					rep.Print(cmd.OutOrStdout())
				}
				return err
			}
			if err := emit(a, cmd, rep, func(w io.Writer) error { rep.Print(w); return nil }); err != nil {
				return err
			}
			if n := rep.Correctness.Failed; n > 0 {
				return fmt.Errorf("%d correctness check(s) failed", n)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&opts.Workload, "workload", "w1", "workload to run: w1, w2, w3 or all")
	cmd.Flags().IntVar(&opts.Iterations, "iterations", 20, "steps (and checkpoints) of the workload")
	cmd.Flags().IntVar(&opts.StandbyRestores, "standby-restores", 1, "standby restores the engine runs at once in the background (as cairnd's --standby-restores)")
	cmd.Flags().BoolVar(&opts.WarmMemory, "warm-memory", true, "first write once to the guest's free memory, so that the hypervisor backs it before anything is timed (~1 min when the host has taken the memory back, as after a boot and again within hours; seconds otherwise; see machine.memory_warmup in the report)")
	cmd.Flags().BoolVar(&noBaselines, "no-baselines", false, "skip the runc_criu, runsc and copytree baselines")
	cmd.Flags().BoolVar(&timeline, "timeline", false, "print every checkpoint's and rollback's phases to standard error, each with when it began and how long it took")
	cmd.Flags().Uint64Var(&opts.Seed, "seed", 0, "seed of the run's random choices (rollback targets, W2's rewards), to repeat another run's (its report's seed); 0 picks one")
	cmd.Flags().StringSliceVar(&opts.Isolation, "isolation", []string{"container", "gvisor"}, "isolation backends to measure, side by side (the top-level figures are container's)")
	return cmd
}
