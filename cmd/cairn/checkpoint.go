package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/engine"
)

func newCheckpointCmd(a *app) *cobra.Command {
	var opts engine.CheckpointOptions
	cmd := &cobra.Command{
		Use:   "checkpoint [flags] SANDBOX",
		Short: "Checkpoint a sandbox's files and processes",
		Long: `Checkpoint takes a joint checkpoint of a running sandbox — its filesystem and its
whole process tree, memory included — and prints the checkpoint's ID as the last line
of standard output. The sandbox is frozen for the duration and then carries on.

The new checkpoint becomes the sandbox's head: its parent is the previous head, so the
checkpoints of a sandbox form a tree (see ` + "`cairn tree`" + `). Roll back to a checkpoint
with ` + "`cairn rollback`" + `, fork it with ` + "`cairn fork`" + `, delete it with ` + "`cairn ckpt rm`" + `.`,
		Example: `  c1=$(cairn checkpoint $id --label before-install)
  cairn checkpoint --json $id`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			ck, err := e.Checkpoint(cmd.Context(), args[0], opts.Label)
			if err != nil {
				return err
			}
			return emit(a, cmd, ck, func(w io.Writer) error {
				_, err := fmt.Fprintln(w, ck.ID)
				return err
			})
		},
	}
	cmd.Flags().StringVarP(&opts.Label, "label", "l", "", "a label for the checkpoint (free text, up to 256 bytes)")
	return cmd
}
