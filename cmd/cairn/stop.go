package main

import (
	"github.com/spf13/cobra"
)

func newStopCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "stop SANDBOX",
		Short: "Stop a sandbox's processes, keeping its files and checkpoints",
		Long: `Stop kills every process of a sandbox. Its root filesystem and checkpoints are
kept; ` + "`cairn resume`" + ` restarts it from its head checkpoint (changes since that
checkpoint are lost then). Prints nothing (the sandbox record with --json).`,
		Example: "  cairn checkpoint $id && cairn stop $id\n  cairn resume $id",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			sb, err := e.Stop(cmd.Context(), args[0])
			if err != nil || !a.json {
				return err
			}
			return printJSON(cmd.OutOrStdout(), sb)
		},
	}
}
