package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"
)

func newGCCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "gc",
		Short: "Delete checkpoints and files nothing references",
		Long: `GC deletes the checkpoints of removed sandboxes that no existing sandbox descends
from (a checkpoint stays while it is an ancestor of any sandbox's checkpoints, head or
origin), and leftovers of interrupted operations. It prints what it removed.`,
		Example: "  cairn rm $id && cairn gc\n  cairn gc --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			rep, err := e.GC(cmd.Context())
			if err != nil {
				return err
			}
			if rep.Checkpoints == nil {
				rep.Checkpoints = []string{}
			}
			if rep.Volumes == nil {
				rep.Volumes = []string{}
			}
			return emit(a, cmd, rep, func(w io.Writer) error {
				for _, c := range rep.Checkpoints {
					fmt.Fprintln(w, "checkpoint", c)
				}
				for _, v := range rep.Volumes {
					fmt.Fprintln(w, "leftover", v)
				}
				fmt.Fprintf(w, "removed %d checkpoint(s), %d leftover(s)\n", len(rep.Checkpoints), len(rep.Volumes))
				return nil
			})
		},
	}
}
