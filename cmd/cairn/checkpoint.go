package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
)

func newCheckpointCmd(a *app) *cobra.Command {
	var opts client.CheckpointRequest
	cmd := &cobra.Command{
		Use:   "checkpoint [flags] SANDBOX",
		Short: "Checkpoint a sandbox's files and processes",
		Long: `Checkpoint takes a joint checkpoint of a running sandbox — its filesystem and its
whole process tree, memory included — and prints the checkpoint's ID as the last line
of standard output. The sandbox is stopped for the duration and then carries on.

Container sandboxes whose processes are all children of init, single-threaded and
simple (files, pipes; no sockets, terminals or threads) are checkpointed resident: each
process forks a frozen copy-on-write copy of itself (a zygote), so no memory is copied,
and a rollback of the sandbox forks the processes again from the zygotes. The
checkpoint's durable copy (CRIU images written from the zygotes) follows in the
background; --durable waits for it and syncs, so that the checkpoint survives a crash
of the machine (without it the latest checkpoints may not, and cairn reports and deletes
what such a crash took at its next start). Other sandboxes are dumped with CRIU. ` + "`cairn inspect CHECKPOINT`" + `
says which path a checkpoint took and why.

The new checkpoint becomes the sandbox's head: its parent is the previous head, so the
checkpoints of a sandbox form a tree (see ` + "`cairn tree`" + `). Roll back to a checkpoint
with ` + "`cairn rollback`" + `, fork it with ` + "`cairn fork`" + `, delete it with ` + "`cairn ckpt rm`" + `.`,
		Example: `  c1=$(cairn checkpoint $id --label before-install)
  cairn checkpoint --durable $id
  cairn checkpoint --json $id`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			ck, err := e.Checkpoint(cmd.Context(), args[0], opts)
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
	cmd.Flags().BoolVar(&opts.Durable, "durable", false, "return only once the checkpoint is on disk whole and synced, so that it survives a crash of the machine (a resident checkpoint is otherwise written to disk in the background, a fraction of a second later)")
	return cmd
}
