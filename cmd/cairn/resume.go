package main

import (
	"github.com/spf13/cobra"
)

func newResumeCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "resume SANDBOX",
		Short: "Restart a stopped sandbox from its head checkpoint",
		Long: `Resume restarts a stopped sandbox (after ` + "`cairn stop`" + `, a crash or a reboot) by
restoring its head checkpoint, files and processes. A running sandbox is left as it
is. A sandbox without any checkpoint cannot be resumed. Prints nothing (the sandbox
record with --json).`,
		Example: "  cairn resume $id",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			sb, err := e.Resume(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return emit(a, cmd, sb, nil)
		},
	}
}
