package main

import (
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func newPrewarmCmd(a *app) *cobra.Command {
	var count int
	cmd := &cobra.Command{
		Use:   "prewarm [flags] CHECKPOINT",
		Short: "Prepare standbys of a checkpoint so the next rollbacks and forks to it are fast",
		Long: `Prewarm makes COUNT standbys of a checkpoint ready — those already ready count, so
running it twice with the same COUNT prepares nothing more — and returns once they
are. A standby is the checkpoint restored ahead of time (a CRIU restore onto its own copy of
the filesystem) and kept frozen before any of its instructions has run. The next
COUNT rollbacks or forks to the checkpoint each take one: a thaw of a few
milliseconds instead of a restore of ~150 ms. A taken standby is replaced in the
background.

Use it before resetting a batch of sandboxes to one checkpoint (RL environments), or
before forking many sandboxes from it. Without prewarm, each new checkpoint gets one
standby in the background, and a rollback or fork that finds none restores.

Cost: one restore per standby made now (~0.1-0.5 s each, one at a time by default), and the
memory of each standby's processes for as long as it is held. Standbys are a cache
bounded by the engine's standby budget (memory and count); beyond it the oldest are
evicted. Only the container backend has standbys: for a gvisor checkpoint, or when
standbys are turned off, prewarm fails with failed_precondition.

It prints the number of standbys of the checkpoint ready afterwards (it may be lower
than COUNT when the budget evicted some); --json prints {"checkpoint", "standbys"}.`,
		Example: `  cairn prewarm $c1
  cairn prewarm -n 16 $warm && for e in $envs; do cairn rollback $e $warm & done; wait
  cairn prewarm --json -n 4 $c1`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if count < 1 || count > engine.MaxFork {
				return errdefs.InvalidArgument("prewarm count %d: give 1 to %d", count, engine.MaxFork)
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			start := time.Now()
			if !a.json {
				fmt.Fprintf(cmd.ErrOrStderr(), "making %d standby(s) of %s ready (a restore each one missing)...\n", count, args[0])
			}
			n, err := e.Prewarm(cmd.Context(), args[0], count)
			if err != nil {
				return err
			}
			st := client.Standbys{Checkpoint: args[0], Standbys: n}
			return emit(a, cmd, st, func(w io.Writer) error {
				_, err := fmt.Fprintf(w, "%s: %d standby(s) ready (%.1f s)\n", st.Checkpoint, st.Standbys, time.Since(start).Seconds())
				return err
			})
		},
	}
	cmd.Flags().IntVarP(&count, "count", "n", 1, fmt.Sprintf("number of standbys to have ready (1 to %d)", engine.MaxFork))
	return cmd
}
