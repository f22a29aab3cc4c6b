package main

import (
	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func newRmCmd(a *app) *cobra.Command {
	var all bool
	cmd := &cobra.Command{
		Use:   "rm [flags] SANDBOX...",
		Short: "Remove sandboxes",
		Long: `Rm stops sandboxes and deletes them with their root filesystems, printing each
removed ID. Their checkpoints stay, since forks and other sandboxes may descend from
them: ` + "`cairn gc`" + ` deletes the ones nothing references any more, ` + "`cairn ckpt rm`" + ` deletes
one explicitly. --all removes every sandbox.

Every named sandbox is attempted; the exit code is that of the first failure.`,
		Example: `  cairn rm $id
  cairn rm $id $(cairn fork $c1 --count 2)
  cairn rm --all`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if all == (len(args) > 0) {
				return errdefs.InvalidArgument("rm needs sandbox IDs or --all (not both)")
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			if all {
				sbs, err := e.List(cmd.Context(), client.ListOptions{})
				if err != nil {
					return err
				}
				for _, sb := range sbs {
					args = append(args, sb.ID)
				}
			}
			return removeAll(a, cmd, args, e.Remove)
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "remove every sandbox")
	return cmd
}
