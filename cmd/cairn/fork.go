package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func newForkCmd(a *app) *cobra.Command {
	var count int
	cmd := &cobra.Command{
		Use:   "fork [flags] CHECKPOINT",
		Short: "Make new sandboxes from a checkpoint",
		Long: `Fork makes new sandboxes from a checkpoint, each with its own copy of the
checkpoint's filesystem and processes (restored with their memory) and its own
identity (ID, hostname, machine-id). Process handles of the checkpoint stay valid in
every fork. The new IDs are printed one per line as the last lines of standard output.

The checkpoint may belong to any sandbox, even a removed one. Forks copy the source
sandbox's labels and limits.`,
		Example: `  cairn fork $c1
  for f in $(cairn fork $c1 --count 4); do cairn exec $f -- python3 try.py & done
  cairn fork --json --count 2 $c1`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if count < 1 || count > 256 {
				return errdefs.InvalidArgument("fork count %d: give 1 to 256", count)
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			sbs, err := e.Fork(cmd.Context(), args[0], client.ForkRequest{Count: count})
			if err != nil {
				return err
			}
			return emit(a, cmd, sbs, func(w io.Writer) error {
				for _, sb := range sbs {
					fmt.Fprintln(w, sb.ID)
				}
				return nil
			})
		},
	}
	cmd.Flags().IntVarP(&count, "count", "n", 1, "number of sandboxes to make (1 to 256)")
	return cmd
}
