package main

import (
	"github.com/spf13/cobra"
)

func newRollbackCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "rollback SANDBOX CHECKPOINT",
		Short: "Return a sandbox to a checkpoint, files and processes",
		Long: `Rollback returns a sandbox to a checkpoint of its lineage: its filesystem is
replaced by the checkpoint's and its processes are restored as they were, memory
included. Processes started after the checkpoint are gone; those that existed then
keep their handles.

The sandbox keeps its ID and the checkpoint becomes its head, so the next checkpoint
branches from it. A checkpoint of another sandbox's lineage cannot be rolled back to:
fork it instead. Prints nothing (the sandbox record with --json).`,
		Example: `  cairn rollback $id $c1
  cairn rollback --json $id $c1`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			sb, err := e.Rollback(cmd.Context(), args[0], args[1])
			if err != nil || !a.json {
				return err
			}
			return printJSON(cmd.OutOrStdout(), sb)
		},
	}
}
